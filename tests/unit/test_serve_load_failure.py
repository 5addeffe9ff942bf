"""`serve` sees a worker that dies while loading from TorchServe's logs (lines as TorchServe
0.12 writes them, taken from a real run) and says why, instead of waiting for READY."""

from __future__ import annotations

from pathlib import Path

from archive_tools import ts_logs

TS_LOG = """\
2026-11-23T00:48:12,747 [INFO ] W-9000-bad_1.0-stdout MODEL_LOG - engine process 9109: loading the model failed
2026-11-23T00:48:14,367 [INFO ] epollEventLoopGroup-5-1 org.pytorch.serve.wlm.AsyncWorkerThread - 9000 Worker disconnected. WORKER_STARTED
"""  # noqa: E501
MODEL_LOG = """\
2026-11-23T00:48:12,808 [INFO ] W-9000-bad_1.0-stdout MODEL_LOG - model_name: bad, batchSize: 1
2026-11-23T00:48:14,159 [INFO ] W-9000-bad_1.0-stdout MODEL_LOG - Backend worker process died.
2026-11-23T00:48:14,164 [INFO ] W-9000-bad_1.0-stdout MODEL_LOG - Traceback (most recent call last):
2026-11-23T00:48:14,164 [INFO ] W-9000-bad_1.0-stdout MODEL_LOG -   File "ts/model_loader.py", line 143, in load
2026-11-23T00:48:14,177 [INFO ] W-9000-bad_1.0-stdout MODEL_LOG - ValueError: `tiktoken` is required to read a `tiktoken` file.
2026-11-23T00:48:14,177 [INFO ] W-9000-bad_1.0-stdout MODEL_LOG - raised in the engine process 9109:
2026-11-23T00:48:14,178 [INFO ] W-9000-bad_1.0-stdout MODEL_LOG - ModuleNotFoundError: No module named 'tiktoken'
2026-11-23T00:48:14,198 [INFO ] W-9000-bad_1.0-stdout MODEL_LOG - ValueError: `tiktoken` is required to read a `tiktoken` file.
"""  # noqa: E501
LOADED = ("2026-11-23T00:50:00,000 [INFO ] epollEventLoopGroup-5-1 org.pytorch.serve.wlm."
          "AsyncWorkerThread - 9000 Worker disconnected. WORKER_MODEL_LOADED\n")


def write_logs(run_dir: Path, ts: str, model: str) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "ts_log.log", "a") as f:
        f.write(ts)
    with open(logs / "model_log.log", "a") as f:
        f.write(model)


def test_death_at_load_names_the_model_and_the_error(tmp_path: Path) -> None:
    sizes = ts_logs.log_sizes(tmp_path)
    write_logs(tmp_path, TS_LOG, MODEL_LOG)
    why = ts_logs.load_failure(tmp_path, sizes)
    first, *rest = why.splitlines()
    assert first == ("model bad: a worker died while loading the model: ValueError: `tiktoken` "
                     "is required to read a `tiktoken` file.")
    assert "  ModuleNotFoundError: No module named 'tiktoken'" in rest
    assert not any("model_name: bad" in line for line in rest)  # only what follows the death


def test_no_failure_while_loading_or_after_loaded(tmp_path: Path) -> None:
    sizes = ts_logs.log_sizes(tmp_path)
    write_logs(tmp_path, "", MODEL_LOG.splitlines(keepends=True)[0])
    assert ts_logs.load_failure(tmp_path, sizes) is None
    write_logs(tmp_path, LOADED, "")  # a worker lost after READY is TorchServe's to restart
    assert ts_logs.load_failure(tmp_path, sizes) is None


def test_an_earlier_runs_failure_is_not_this_ones(tmp_path: Path) -> None:
    write_logs(tmp_path, TS_LOG, MODEL_LOG)
    assert ts_logs.load_failure(tmp_path, ts_logs.log_sizes(tmp_path)) is None


def test_polls_read_only_new_whole_lines(tmp_path: Path) -> None:
    watch = ts_logs.LoadWatch(tmp_path, ts_logs.log_sizes(tmp_path))
    head, tail = TS_LOG.split("Worker disconnected. WORKER_")
    write_logs(tmp_path, head + "Worker disconnected. WORKER_", "")
    assert not watch.died({"bad"})  # half a line: not yet
    write_logs(tmp_path, tail, "")
    assert watch.died({"bad"})
    assert not watch.died({"bad"})  # already read


# a worker that cannot bind its socket (a 114-byte path), as TorchServe 0.12 logged it: no
# "Worker disconnected" (it never connected), its traceback, then the frontend's retry
P = "/tmp/" + "d" * 80 + "/run/tmp"
BIND_MODEL_LOG = f"""\
2026-11-27T19:56:54,353 [INFO ] W-9000-tiny_1.0-stdout MODEL_LOG - Listening on port: {P}/.ts.sock.9000
2026-11-27T19:56:54,753 [INFO ] W-9000-tiny_1.0-stdout MODEL_LOG - Backend worker process died.
2026-11-27T19:56:54,754 [INFO ] W-9000-tiny_1.0-stdout MODEL_LOG - Traceback (most recent call last):
2026-11-27T19:56:54,868 [INFO ] W-9000-tiny_1.0-stdout MODEL_LOG -     self.sock.bind(self.sock_name)
2026-11-27T19:56:54,868 [INFO ] W-9000-tiny_1.0-stdout MODEL_LOG - OSError: AF_UNIX path too long
"""  # noqa: E501
BIND_TS_LOG = """\
2026-11-27T19:57:03,828 [ERROR] W-9000-tiny_1.0 org.pytorch.serve.wlm.AsyncWorkerThread - Backend worker error
org.pytorch.serve.wlm.WorkerInitializationException: Backend stream closed.
2026-11-27T19:57:03,977 [INFO ] W-9000-tiny_1.0 org.pytorch.serve.wlm.WorkerThread - Retry worker: 9000 in 1 seconds.
"""  # noqa: E501


def test_a_worker_that_dies_before_it_connects_is_seen_by_its_traceback(tmp_path: Path) -> None:
    sizes = ts_logs.log_sizes(tmp_path)
    watch = ts_logs.LoadWatch(tmp_path, sizes)
    write_logs(tmp_path, "", BIND_MODEL_LOG)
    assert not watch.died({"other"})  # another model's worker: not this one's business
    watch = ts_logs.LoadWatch(tmp_path, sizes)
    assert watch.died({"tiny"})
    write_logs(tmp_path, BIND_TS_LOG, "")
    first = ts_logs.load_failure(tmp_path, sizes).splitlines()[0]
    assert first == ("model tiny: a worker died while loading the model: OSError: AF_UNIX path "
                     "too long")


def test_a_worker_restarted_again_and_again_is_given_up_on_whatever_the_reason(
        tmp_path: Path) -> None:
    """Killed before it wrote a word (out of memory, say): only the frontend's retries."""
    sizes = ts_logs.log_sizes(tmp_path)
    watch = ts_logs.LoadWatch(tmp_path, sizes)
    for _ in range(ts_logs.MAX_LOAD_RETRIES):
        assert not watch.died({"tiny"})
        write_logs(tmp_path, BIND_TS_LOG, "")
    assert watch.died({"tiny"})
    first = ts_logs.load_failure(tmp_path, sizes).splitlines()[0]
    assert first == ("model tiny: a worker died while loading the model: "
                     "org.pytorch.serve.wlm.WorkerInitializationException: Backend stream "
                     "closed. (the frontend's words; the worker wrote no traceback)")


def test_paths_in_torchserves_copy_are_named_by_the_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "tiny").mkdir(parents=True)
    copy = "/models/430cfe6e5ecf45918da12149624b42d5"
    link = "/tmp/inf2s-z_rb1f_n/t"
    text = (f"ConfigError: {link}{copy}/tiny/model/config.json: not valid JSON; also "
            f"{tmp_path}/run/tmp{copy}/tiny/model")
    dirs = [f"{tmp_path}/run/tmp", link]
    assert ts_logs.store_paths(text, store / "tiny", dirs) == (
        f"ConfigError: {store}/tiny/model/config.json: not valid JSON; also {store}/tiny/model")
    assert ts_logs.store_paths(f"{link}{copy}/model/config.json: bad", store / "tiny.mar",
                               dirs) == f"{store}/tiny.mar:model/config.json: bad"


def test_frontend_exit_quotes_the_exception_without_stack_frames(tmp_path: Path) -> None:
    (tmp_path / ts_logs.FRONTEND_OUT).write_text("an earlier run's output\n")
    sizes = ts_logs.log_sizes(tmp_path)
    with open(tmp_path / ts_logs.FRONTEND_OUT, "a") as f:  # as a real run printed it
        f.write("2026-11-23T09:46:16,707 [INFO ] main org.pytorch.serve.ModelServer - Metrics API"
                " bind to: http://127.0.0.1:34675\n"
                "2026-11-23T09:46:19,544 [INFO ] main org.pytorch.serve.ModelServer - Torchserve"
                " stopped.\n"
                "java.io.IOException: Failed to bind to address /127.0.0.1:44081\n"
                "\tat io.grpc.netty.shaded.io.grpc.netty.NettyServer.start(NettyServer.java:328)\n"
                "Caused by: io.grpc.netty.shaded.io.netty.channel.unix.Errors$NativeIoException: "
                "bind(..) failed: Address already in use\n"
                "\t... 9 more\n")
    assert ts_logs.frontend_exit(tmp_path, sizes) == (
        "java.io.IOException: Failed to bind to address /127.0.0.1:44081\n"
        "Caused by: io.grpc.netty.shaded.io.netty.channel.unix.Errors$NativeIoException: "
        "bind(..) failed: Address already in use")
    assert ts_logs.PORT_TAKEN in ts_logs.frontend_exit(tmp_path, sizes)
    assert ts_logs.frontend_exit(tmp_path, ts_logs.log_sizes(tmp_path)) == ""  # nothing new


def test_free_ports_lie_below_the_ephemeral_range() -> None:
    from archive_tools.ports import SPAN, _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1
    if low - SPAN >= 1024:  # else the range leaves no room and any free port will do
        assert all(low - SPAN <= p < low for p in ports), (low, ports)
