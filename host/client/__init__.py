"""Python client of `pie serve`: async on trio (`connect`) and a blocking wrapper (`SyncClient`)."""
from host.client.client import Event, Instance, PieClient, PieError, connect, websocket_url
from host.client.sync import SyncClient

__all__ = ["Event", "Instance", "PieClient", "PieError", "connect", "websocket_url", "SyncClient"]
