"""I/O worker: reads byte ranges of manifest files into slab slots on command.

Run as `python -m ioworker ...` (its command line: `shared.commands.IOWorkerArgs`);
the coordinator side is `coordinator.backend`.
"""
