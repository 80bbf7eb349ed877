"""The coordinator process: `python -m coordinator --config RUN_DIR/config.json [--death-fd N]`.

One entry function, `run_coordinator`: setup (attach the slab, open the
store and the usage ledger, bind the I/O, GPU and jobs ROUTERs, build the
`coordinator.service.Coordinator`), a single-threaded asyncio loop running
its tasks (I/O workers' replies, the GPU worker's lease protocol and job
messages, clients' requests, a GPU-worker watchdog, the periodic ledger
flush), and a `finally` that closes every socket before the context and
flushes the ledger. It never unlinks the slab: the supervisor owns it. Exits
on SIGTERM/SIGINT or when the parent's death pipe reports end of file
(`shared.process.ProcessLife.watch_loop`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

import zmq
import zmq.asyncio

from coordinator.backend import IOWorkerBackend
from coordinator.liveness import ProgressDeadline
from coordinator.service import GPU_MAX_MESSAGE_BYTES, JOBS_MAX_MESSAGE_BYTES, Coordinator
from coordinator.usage import ExpertUsageLedger
from shared.commands import parse_coordinator_argv
from shared.config import RunConfig, read_config
from shared.curve import load_server_keys
from shared.loop_socket import LoopSocket, plain_context
from shared.process import ProcessLife
from shared.scheduling import enter_helper_scheduling
from shared.slab import Slab
from shared.sockets import open_socket
from shared.store import ExpertStore

logger = logging.getLogger("coordinator")

EXIT_OK, EXIT_FAILED = 0, 1


def _check(config: RunConfig, store: ExpertStore) -> None:
    if store.slot_bytes != config.plan.slot_bytes or len(store.sparse_layers) != config.plan.sparse_layers:
        raise ValueError(
            f"the store ({store.slot_bytes}-byte slots, {len(store.sparse_layers)} sparse layers) does "
            f"not match the plan ({config.plan.slot_bytes}, {config.plan.sparse_layers})"
        )
    if len(store.manifest) != config.manifest_files:
        raise ValueError(f"the store has {len(store.manifest)} files; the manifest {config.manifest_files}")


async def run_coordinator(config: RunConfig, *, death_fd: int | None = None) -> int:
    """Serve until SIGTERM/SIGINT or the parent's death; the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    life = ProcessLife(death_fd=death_fd)

    def on_stop(reason: str) -> None:
        if reason.startswith("parent"):
            logger.warning("%s; exiting", reason)
        stop.set()

    life.watch_loop(loop, on_stop)
    context = zmq.asyncio.Context()
    slab = coordinator = ledger = io = None
    sockets: list[LoopSocket | zmq.asyncio.Socket] = []
    tasks: list[asyncio.Task] = []
    code = EXIT_OK
    try:
        slab = Slab.attach(
            config.slab.name,
            total_slots=config.slab.total_slots,
            slot_bytes=config.slab.slot_bytes,
            tail_bytes=config.slab.tail_bytes,
        )
        store = ExpertStore.open(config.model_dir, block_size=config.block_size)
        _check(config, store)
        if config.usage_file:
            ledger = ExpertUsageLedger.open(
                config.usage_file, layers=store.sparse_layers, experts_per_layer=store.experts_per_layer
            )
        io = IOWorkerBackend(
            slab=slab,
            endpoint=config.endpoints.io,
            workers=config.io_workers,
            files=len(store.manifest),
            context=context,
            replacement_grace_s=config.io_replacement_grace_s,
            deadline=ProgressDeadline(
                timeout_s=config.hang_timeout_s, per_load_s=(config.test_io_read_delay_ms or 0.0) / 1e3
            ),
        )
        # Only the job front door may face the network: a CURVE server when the run has keys.
        curve = load_server_keys(config.curve_keys) if config.curve_keys else None
        # The GPU worker's messages, tens a decode token, come through a plain socket served from the
        # loop (shared.loop_socket); the clients' through zmq.asyncio.
        gpu = open_socket(
            plain_context(context), zmq.ROUTER, bind=config.endpoints.gpu, max_message_bytes=GPU_MAX_MESSAGE_BYTES
        )
        sockets.append(LoopSocket(gpu))
        sockets.append(
            open_socket(
                context, zmq.ROUTER, bind=config.endpoints.jobs, max_message_bytes=JOBS_MAX_MESSAGE_BYTES, curve=curve
            )
        )
        sockets[0].start()
        coordinator = Coordinator(
            config=config, store=store, slab=slab, io=io, gpu_sock=sockets[0], jobs_sock=sockets[1], ledger=ledger
        )
        logger.info(
            "serving %s: %d slots of %d bytes (%d working, %d per layer, %d pinned, replacement %s); jobs at %s%s",
            config.model_dir,
            config.plan.total_slots,
            config.plan.slot_bytes,
            config.plan.working_slots,
            config.plan.slots_per_layer,
            config.plan.pinned_slots,
            coordinator.manager.replacement,
            config.endpoints.jobs,
            " (CURVE)" if curve else "",
        )
        tasks = [
            loop.create_task(coro, name=coro.__name__)
            for coro in (
                coordinator.start_io(),
                coordinator.serve_gpu(),
                coordinator.serve_jobs(),
                coordinator.watch_gpu(),
                coordinator.sizing.hold(),
                coordinator.safepoints.flush_periodically(),
            )
        ]
        stopper = loop.create_task(stop.wait(), name="stop")
        pending = {stopper, *tasks}
        while stopper in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [task for task in done if task is not stopper and task.exception() is not None]
            if failed:  # the I/O workers never became ready, or a server loop broke
                for task in failed:
                    logger.error("%s failed: %s", task.get_name(), task.exception())
                code = EXIT_FAILED
                break
        stopper.cancel()
        logger.info("stopping")
        return code
    except Exception as error:
        logger.error("coordinator failed: %s", error, exc_info=not isinstance(error, (OSError, ValueError)))
        return EXIT_FAILED
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            if coordinator is not None:
                coordinator.shutdown()
                await asyncio.sleep(0.05)  # linger is 0: let the last replies and shutdowns leave first
        finally:
            if coordinator is not None:
                coordinator.meter.close()
            for sock in sockets:  # every socket closed before the context is terminated
                if isinstance(sock, LoopSocket):
                    sock.close()
                else:
                    sock.close(linger=0)
            if io is not None:
                await io.aclose()
            if ledger is not None:
                try:
                    ledger.flush()
                except OSError as error:
                    logger.error("usage ledger flush failed: %s", error)
            if slab is not None:
                slab.close()
            context.term()
            life.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_coordinator_argv(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s coordinator[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = read_config(args.config)
    except ValueError as error:
        logger.error("%s", error)
        return EXIT_FAILED
    logging.getLogger().setLevel((args.log_level or config.log_level).upper())
    enter_helper_scheduling(config.helper_scheduling)  # every thread, and the ones started from here on
    return asyncio.run(run_coordinator(config, death_fd=args.death_fd))


__all__ = ["main", "run_coordinator"]
