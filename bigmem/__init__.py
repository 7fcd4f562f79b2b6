"""bigmem: train 3D U-Nets on whole volumes in the RAM of one large CPU server.

Importing this package never imports TensorFlow; each command imports it when it needs it.
"""

__version__ = "0.1.0"
