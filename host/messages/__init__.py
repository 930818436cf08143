"""The messages room: what instances, their clients and each other exchange.

- hub.py  MessageHub (per-runtime), InstanceChannel (one instance's view), Inbox (bounded queue),
          KeyValueStore (per tenant)

May import: host.errors only.
"""
