"""NUMA topology, memory policy and thread placement."""
