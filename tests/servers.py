"""Real servers on 127.0.0.1 for the reward-server tests: an ASGI app under uvicorn in a
thread, and a bare TCP listener that drops each connection (the fault no HTTP framework
produces on purpose)."""

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
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", timeout_graceful_shutdown=1))
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
