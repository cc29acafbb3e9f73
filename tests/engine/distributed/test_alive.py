"""Signs of life: the beat line a rank writes, and keepalive on its TCP links."""

from __future__ import annotations

import io
import socket
import threading
import time

from engine.distributed import alive


def test_a_beat_names_its_rank_wherever_the_relay_puts_it() -> None:
    out, stop = io.StringIO(), threading.Event()
    beating = alive.start_beating(3, out, stop)
    time.sleep(0.2)
    stop.set()
    beating.join()
    line = out.getvalue().splitlines()[0]
    assert alive.beating_rank(line) == 3
    # Over ssh -tt the tty ends lines with \r\n, and a line may come after others.
    assert alive.beating_rank(f"partial output{line}\r\n") == 3
    assert alive.beating_rank("longleaf:alive") is None
    assert alive.beating_rank("error: rank 1 failed") is None


def test_every_tcp_socket_of_the_process_gets_keepalive_and_plain_sockets_are_left() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
            assert alive.guard_links() >= 3  # the server, the client and its peer
            for sock in (client, peer):
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                if hasattr(socket, "TCP_KEEPIDLE"):
                    assert sock.getsockopt(socket.IPPROTO_TCP,
                                           socket.TCP_KEEPIDLE) == alive.KEEPALIVE_IDLE
            assert udp.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
            # The sockets still carry data as before.
            client.sendall(b"ping")
            assert peer.recv(4) == b"ping"
        finally:
            for sock in (client, peer, udp):
                sock.close()
