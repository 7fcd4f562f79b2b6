"""``bigmem info``: CPU, ISA, memory, NUMA nodes, TensorFlow, oneDNN, GPUs."""

from __future__ import annotations

import json

HELP = "show the machine as bigmem sees it"


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("info", help=HELP, description=HELP.capitalize() + ".", parents=parents)
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--no-tensorflow", action="store_true",
                        help="skip TensorFlow (faster; no TF version, oneDNN or GPU lines)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from bigmem import api
    from bigmem.cpu import ISA_CLASS_VARIABLE
    from bigmem.units import format_bytes

    info = api.info(tensorflow=not args.no_tensorflow, verbose=getattr(args, "verbose", False))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    console = Console(soft_wrap=True)
    cpu = info["cpu"]
    machine = Table(title="machine", show_header=False)
    machine.add_row("host", info["hostname"])
    machine.add_row("CPU", f"{cpu['model']} ({cpu['logical_cpus']} logical CPUs, {cpu['physical_cores']} cores)")
    present = [k for k, v in cpu["isa"].items() if v]
    absent = [k for k, v in cpu["isa"].items() if not v]
    machine.add_row("ISA", " ".join(present) + (f"; absent: {' '.join(absent)}" if absent else "")
                    + (f" (class {cpu['isa_class_forced']} forced by {ISA_CLASS_VARIABLE}; oneDNN runs this CPU's "
                       "own)" if cpu.get("isa_class_forced") else ""))
    machine.add_row("memory", f"{format_bytes(info['memory']['total_bytes'])} total, "
                              f"{format_bytes(info['memory']['available_bytes'])} available")
    if "tensorflow" in info:
        tf_info = info["tensorflow"]
        machine.add_row("TensorFlow", f"{tf_info['tensorflow']} (Keras {tf_info['keras']})")
        onednn = "on" if tf_info["onednn_enabled"] else ("off" if tf_info["onednn_built"] else "not in this build")
        machine.add_row("oneDNN", f"{onednn}: {tf_info['onednn_reason']}")
        machine.add_row("GPUs", ", ".join(tf_info["gpus"]) or "none")
    tuned = info["tuning"]
    machine.add_row("kernels", tuned["tuned"] + f" ({tuned['file']})" if tuned["file"]
                    else f"shipped tables (not tuned for {tuned['key']}; bigmem tune)")
    console.print(machine)
    terms = Table(title="memory plan's fixed term per network (training, fp32)", show_header=False)
    for preset, status in info["memory_terms"].items():
        terms.add_row(preset, status)
    console.print(terms)
    nodes = Table(title=f"NUMA nodes (from {info['numa']['source']}; libnuma {info['numa']['libnuma']})")
    for column in ("node", "CPUs", "memory total", "memory free", "distances"):
        nodes.add_column(column)
    for node in info["numa"]["nodes"]:
        nodes.add_row(str(node["node"]), _cpu_ranges(node["cpus"]), format_bytes(node["total_bytes"]),
                      format_bytes(node["free_bytes"]), " ".join(map(str, node["distances"])))
    console.print(nodes)
    return 0


def _cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    parts, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            parts.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(parts)
