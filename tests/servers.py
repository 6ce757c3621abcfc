"""Real servers on 127.0.0.1 for the HTTP tests (rewards, rollout engine): an ASGI app under
uvicorn in a thread, a bare TCP listener that drops each connection, and a TCP proxy that
breaks one exchange halfway through its answer (faults no HTTP framework produces on purpose)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from omni.distributed import free_port


@contextlib.contextmanager
def uvicorn_server(app):
    """Serve `app` on a free port of 127.0.0.1; yields its URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)


@contextlib.contextmanager
def dropping_server():
    """A listener that reads each request and closes the connection without answering;
    yields (url, accepted) where `accepted` counts the connections."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except socket.timeout:
                continue
            with connection:
                accepted.append(time.monotonic())
                connection.recv(65536)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def _pump(source: socket.socket, sink: socket.socket, on_data) -> None:
    """Copy bytes until either side closes; `on_data(chunk)` may return a shorter chunk to
    send and then cut both connections."""
    try:
        while True:
            chunk = source.recv(65536)
            if not chunk:
                break
            cut = on_data(chunk)
            sink.sendall(chunk if cut is None else cut)
            if cut is not None:
                for side in (source, sink):  # also wakes the other direction's recv
                    with contextlib.suppress(OSError):
                        side.shutdown(socket.SHUT_RDWR)
                break
    except OSError:
        pass
    finally:
        for side in (source, sink):
            with contextlib.suppress(OSError):
                side.close()


@contextlib.contextmanager
def breaking_proxy(upstream: str, request_start: bytes, breaks: int = 1):
    """A TCP proxy to `upstream` (http://host:port) that lets the first `breaks` requests
    starting with `request_start` (e.g. b"POST /generate ") reach the server, then forwards
    half of the answer's first chunk and drops both connections. Yields (url, seen): `seen`
    counts the requests that started with `request_start`."""
    host, port = upstream.rsplit("//", 1)[1].split(":")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    seen, stop = [], threading.Event()

    def connect(client: socket.socket) -> None:
        server = socket.create_connection((host, int(port)))
        doomed = []

        def request(chunk):
            if chunk.startswith(request_start):
                seen.append(time.monotonic())
                if len(seen) <= breaks:
                    doomed.append(True)
            return None

        def answer(chunk):
            return chunk[: len(chunk) // 2] if doomed else None

        threading.Thread(target=_pump, args=(client, server, request), daemon=True).start()
        threading.Thread(target=_pump, args=(server, client, answer), daemon=True).start()

    def serve():
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except socket.timeout:
                continue
            connect(client)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
