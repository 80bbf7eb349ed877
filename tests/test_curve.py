"""Network exposure: a jobs endpoint other machines can reach is served only with ZeroMQ CURVE.

The endpoint rule (`shared.config.check_jobs_endpoint`): loopback tcp and ipc need no keys, any
other tcp host needs --curve / --curve-keys. The key files (`shared.curve`): 0600 in a 0700
directory, a looser secret refused by name and mode. CURVE sockets (`shared.sockets.open_socket`):
a client with the server's key is served, one without a key or with a wrong one gets nothing, and
the frame bound is the same as without CURVE. Then the real system: `moeslab-launch` refuses a
non-loopback endpoint without --curve (exit 2, the endpoint named); with --curve it serves a job
token-exact to `Client` and `moeslab-send` given the server key, nothing to clients without it,
and leaves nothing behind; --curve-keys takes an existing pair (zmq.auth's certificate files).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import stat
from pathlib import Path

import psutil
import pytest
import zmq
import zmq.auth

from shared import cli_send
from shared.client import Client, ClientTimeout
from shared.config import (
    ConfigError,
    Endpoints,
    RunConfig,
    check_jobs_endpoint,
    config_from_dict,
    config_to_dict,
    endpoint_exposed,
    run_endpoints,
)
from shared.curve import (
    CURVE_DIR,
    SERVER_PUBLIC_FILE,
    SERVER_SECRET_FILE,
    CurveError,
    client_curve,
    load_server_keys,
    new_server_keys,
    read_server_key,
    write_server_keys,
)
from shared.sockets import open_socket
from supervisor.options import parse_args
from tests.helpers.run_config import small_run_config
from tests.helpers.supervisor import (
    assert_all_gone,
    check_tokens,
    launch,
    model_args,
    oracle_tokens,
    run_dirs,
    tiny_model,
)
from tests.helpers.system import PROMPT

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")

# A client without the right key never completes the handshake: it hears nothing, quickly.
SILENT_S = 2.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        return probe.getsockname()[1]


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ------------------------------------------------------------------------------ the endpoint rule


def test_exposed_tcp_endpoints_need_curve_and_loopback_ones_do_not():
    for local in ("tcp://127.0.0.1:5555", "tcp://127.0.0.2:80", "tcp://localhost:5555", "tcp://[::1]:5555"):
        assert not endpoint_exposed(local) and check_jobs_endpoint(local) == local
    assert not endpoint_exposed("ipc:///tmp/x/jobs") and check_jobs_endpoint("ipc:///tmp/x/jobs", curve=True)
    for exposed in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://192.0.2.7:80", "tcp://eth0:5555", "tcp://[fd00::2]:9"):
        assert endpoint_exposed(exposed)
        with pytest.raises(ValueError) as refused:
            check_jobs_endpoint(exposed)
        assert exposed in str(refused.value) and "--curve" in str(refused.value)
        assert check_jobs_endpoint(exposed, curve=True) == exposed
    for bad in ("tcp://0.0.0.0:0", "tcp://::1:5555", "tcp://:5555", "tcp://0.0.0.0"):
        with pytest.raises(ValueError):
            check_jobs_endpoint(bad, curve=True)


def round_trip(config: RunConfig) -> RunConfig:
    """Through JSON, as config.json travels to the coordinator."""
    return config_from_dict(json.loads(json.dumps(config_to_dict(config))))


def test_a_run_config_with_an_exposed_endpoint_needs_curve_keys(tmp_path):
    endpoints = run_endpoints(tmp_path)
    config = small_run_config(
        tmp_path, endpoints=Endpoints(io=endpoints.io, gpu=endpoints.gpu, jobs="tcp://0.0.0.0:5555")
    )
    with pytest.raises(ConfigError) as refused:
        round_trip(config)
    assert "tcp://0.0.0.0:5555" in str(refused.value) and "curve_keys" in str(refused.value)
    keyed = dataclasses.replace(config, curve_keys=str(tmp_path / CURVE_DIR))
    assert round_trip(keyed) == keyed
    with pytest.raises(ConfigError, match="absolute"):
        round_trip(dataclasses.replace(config, curve_keys="curve"))


def test_launch_flags_curve_and_curve_keys():
    base = ["--model", "m", "--memory-budget", "1GiB", "--endpoint", "tcp://0.0.0.0:5555"]
    with pytest.raises(SystemExit) as refused:
        parse_args(base)
    assert refused.value.code == 2
    options = parse_args([*base, "--curve"])
    assert options.curve and options.curve_keys is None and options.endpoint == "tcp://0.0.0.0:5555"
    options = parse_args([*base, "--curve-keys", "/keys"])
    assert not options.curve and options.curve_keys == "/keys"
    with pytest.raises(SystemExit):
        parse_args([*base, "--curve", "--curve-keys", "/keys"])  # one or the other
    assert parse_args(["--model", "m", "--memory-budget", "1GiB"]).curve is False


# ------------------------------------------------------------------------------ key files


def test_key_files_are_private_and_a_loose_secret_is_refused(tmp_path):
    keys = new_server_keys()
    directory = tmp_path / CURVE_DIR
    created = write_server_keys(directory, keys)
    secret, public = directory / SERVER_SECRET_FILE, directory / SERVER_PUBLIC_FILE
    assert created == [str(secret), str(public), str(directory)]
    assert (mode(secret), mode(public), mode(directory)) == (0o600, 0o600, 0o700)
    assert load_server_keys(directory) == keys
    assert b"secret-key" not in public.read_bytes()
    # zmq.auth reads what we write; a client takes the key itself or either file.
    assert zmq.auth.load_certificate(secret) == (keys.server_public, keys.server_secret)
    for given in (keys.server_public.decode(), str(public), str(secret)):
        assert read_server_key(given) == keys.server_public
    bare = tmp_path / "bare.key"
    bare.write_text(keys.server_public.decode() + "\n")
    assert read_server_key(str(bare)) == keys.server_public

    os.chmod(secret, 0o644)
    with pytest.raises(CurveError) as loose:
        load_server_keys(directory)
    assert str(secret) in str(loose.value) and "0644" in str(loose.value)

    for bad in ("short", "~" * 40, str(tmp_path / "missing.key")):
        with pytest.raises(CurveError) as refused:
            read_server_key(bad)
        assert repr(bad) in str(refused.value)
    with pytest.raises(ValueError):
        Client("tcp://127.0.0.1:1", server_key="not a key")


# ------------------------------------------------------------------------------ CURVE sockets


def test_only_a_client_with_the_server_key_is_heard_and_the_frame_bound_holds():
    keys = new_server_keys()
    context = zmq.Context()
    server = open_socket(context, zmq.ROUTER, bind="tcp://127.0.0.1:0", max_message_bytes=1000, curve=keys)
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)

    def heard(server_key: bytes | None, size: int = 10) -> bool:
        client = open_socket(context, zmq.DEALER, connect=endpoint, unbounded=False, curve=client_curve(server_key))
        try:
            client.send(b"x" * size)
            if not server.poll(SILENT_S * 1000):
                return False
            identity, frame = server.recv_multipart()
            server.send_multipart([identity, b"ok"])
            return client.poll(SILENT_S * 1000) and client.recv() == b"ok" and len(frame) == size
        finally:
            client.close(linger=0)

    try:
        assert heard(keys.server_public)
        assert not heard(None)
        assert not heard(new_server_keys().server_public)
        # The bound is the frame's, as without CURVE (libzmq counts the encrypted size).
        assert heard(keys.server_public, 1000)
        assert not heard(keys.server_public, 1001)
        assert heard(keys.server_public)  # still serving after the refusals
    finally:
        server.close(linger=0)
        context.term()


# ------------------------------------------------------------------------------ the real system


def test_a_non_loopback_endpoint_without_curve_is_refused_at_launch(model, tmp_path):
    endpoint = f"tcp://0.0.0.0:{free_port()}"
    launched = launch(tmp_path, [*model_args(model), "--endpoint", endpoint], expect_ready=False, timeout=60)
    stderr = launched.stderr()
    assert launched.process.returncode == 2, stderr
    assert endpoint in stderr and "--curve" in stderr, stderr
    assert not run_dirs(tmp_path)


def test_curve_serves_only_clients_with_the_server_key_and_leaves_nothing(model, tmp_path, capsys):
    want = oracle_tokens(model)
    port = free_port()
    run_dir = tmp_path / "run"
    launched = launch(
        tmp_path,
        [*model_args(model), "--endpoint", f"tcp://0.0.0.0:{port}", "--curve", "--run-dir", str(run_dir)],
    )
    ready = launched.ready
    key = ready["curve_public_key"]
    curve_dir = run_dir / CURVE_DIR
    assert read_server_key(str(curve_dir / SERVER_PUBLIC_FILE)).decode() == key
    assert load_server_keys(curve_dir).server_public.decode() == key
    assert mode(curve_dir) == 0o700
    assert mode(curve_dir / SERVER_SECRET_FILE) == mode(curve_dir / SERVER_PUBLIC_FILE) == 0o600
    endpoint = f"tcp://127.0.0.1:{port}"  # the front door listens on every interface

    # No key, a wrong key: no service (the handshake never completes).
    for server_key in (None, new_server_keys().server_public):
        with Client(endpoint, timeout=SILENT_S, server_key=server_key) as client, pytest.raises(ClientTimeout):
            client.generate(prompt_tokens=list(PROMPT), max_tokens=4).result()

    # The right key: the same greedy tokens as mlx-lm (and as any plain run of this model).
    with Client(endpoint, timeout=60, server_key=key) as client:
        check_tokens(list(client.generate(prompt_tokens=list(PROMPT), max_tokens=len(want)).result().tokens), want)
        assert client.health().ready

    # moeslab-send takes the key file.
    prompt = ",".join(map(str, PROMPT))
    argv = ["--endpoint", endpoint, "--prompt-tokens", prompt, "--max-tokens", "4", "--json", "--timeout", "60"]
    assert cli_send.main([*argv, "--server-key", str(curve_dir / SERVER_PUBLIC_FILE)]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["tokens"] == want[: len(done["tokens"])] and done["finish_reason"] in ("length", "stop")
    assert cli_send.main([*argv, "--server-key", "not-a-key"]) == 2
    assert "not-a-key" in capsys.readouterr().err

    assert launched.signal(signal.SIGTERM) == 0, launched.stderr()[-4000:]
    for pid in ready["pids"].values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert not os.path.exists(f"/dev/shm{ready['slab']}")
    assert run_dir.is_dir() and not list(run_dir.iterdir())  # the given directory stays, emptied


def test_curve_keys_takes_an_existing_pair_and_refuses_a_loose_secret(model, tmp_path):
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    public_file, secret_file = zmq.auth.create_certificates(keys_dir, "server")  # the umask's modes
    os.chmod(secret_file, 0o640)
    loose = launch(tmp_path, [*model_args(model), "--curve-keys", str(keys_dir)], expect_ready=False, timeout=60)
    stderr = loose.stderr()
    assert loose.process.returncode != 0 and secret_file in stderr and "0640" in stderr, stderr
    assert not run_dirs(tmp_path)

    os.chmod(secret_file, 0o600)
    public, _ = zmq.auth.load_certificate(public_file)
    launched = launch(tmp_path, [*model_args(model), "--curve-keys", str(keys_dir), "--io-workers", "1"])
    assert launched.ready["curve_public_key"] == public.decode()
    # CURVE is optional on ipc: here it is on, so only a keyed client is served.
    with Client(launched.endpoint, timeout=SILENT_S) as plain, pytest.raises(ClientTimeout):
        plain.health()
    with Client(launched.endpoint, timeout=60, server_key=public) as client:
        assert client.health().ready
    assert launched.signal(signal.SIGTERM) == 0, launched.stderr()[-4000:]
    assert_all_gone(launched)
    assert sorted(os.listdir(keys_dir)) == ["server.key", "server.key_secret"]  # the user's pair stays


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_an_ipv6_loopback_endpoint_binds_and_connects_with_curve():
    keys = new_server_keys()
    context = zmq.Context()
    try:
        server = open_socket(context, zmq.ROUTER, bind="tcp://[::1]:0", curve=keys)
    except zmq.ZMQError as error:  # a host without an IPv6 loopback
        context.term()
        pytest.skip(f"no IPv6 loopback: {error}")
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
    client = open_socket(context, zmq.DEALER, connect=endpoint, unbounded=False, curve=client_curve(keys.server_public))
    try:
        assert endpoint.startswith("tcp://[::1]:") and not endpoint_exposed(endpoint)
        client.send(b"hello")
        assert server.poll(10_000) and server.recv_multipart()[1] == b"hello"
    finally:
        client.close(linger=0)
        server.close(linger=0)
        context.term()
