"""The HTTP destination's connections close with a reset.

After a read timeout the request may still wait, unacknowledged, in the kernel's send
queue (the network between us and the receiver is cut). Closed normally, the kernel
would keep retransmitting it and the receiver would apply it once the network heals:
after a lookup found nothing and the action was resent. The partition drill
(``tests/drills/test_partition.py``) counted that duplicate before this; here the
option itself is checked on a real connection to a real server.
"""

import socket
import struct

from durable.actions import destinations
from durable.testing import Receiver


def test_every_connection_the_destination_opens_resets_on_close_instead_of_retransmitting():
    with Receiver() as receiver:
        session = destinations.session()
        reply = session.get(f"{receiver.url}/actions/lookup?key=nothing", timeout=(1, 2))
        assert reply.status_code == 404
        pool = session.get_adapter(receiver.url).poolmanager.connection_from_url(receiver.url)
        conn = pool._new_conn()  # a connection as the pool opens them, to the same server
        conn.connect()
        onoff, seconds = struct.unpack("ii", conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8))
        assert (onoff, seconds) == (1, 0)
        # The usual options are kept beside it.
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        conn.close()


def _fresh_connection(receiver):
    session = destinations.session()
    pool = session.get_adapter(receiver.url).poolmanager.connection_from_url(receiver.url)
    conn = pool._new_conn()
    conn.connect()
    return conn


def test_a_sends_bytes_may_wait_unacknowledged_only_until_just_before_the_shortest_send_lease(settings):
    """A frozen dispatcher closes nothing: the kernel drops its unacknowledged request itself.

    ``TCP_USER_TIMEOUT`` is LEASE_SECONDS - LEASE_MARGIN_SECONDS by default, below every
    send's lease, so no request of a dispatcher cut off and frozen mid-send can arrive
    after another dispatcher took its row over (``tests/drills/test_frozen_send.py``).
    """
    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "LEASE_SECONDS": 40, "LEASE_MARGIN_SECONDS": 4}
    destinations._sessions.clear()
    try:
        with Receiver() as receiver:
            conn = _fresh_connection(receiver)
            assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 36_000
            conn.close()
    finally:
        destinations._sessions.clear()


def test_the_unacknowledged_bound_follows_its_setting_and_zero_leaves_the_kernels_default(settings):
    for value, expected in ((12.5, 12_500), (0, 0)):
        settings.DURABLE = {**getattr(settings, "DURABLE", {}), "DISPATCH_UNACKED_SECONDS": value}
        destinations._sessions.clear()
        try:
            with Receiver() as receiver:
                conn = _fresh_connection(receiver)
                assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == expected
                conn.close()
        finally:
            destinations._sessions.clear()
