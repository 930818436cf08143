"""The KV room: who holds which KV page.

- allocator.py      PageAllocator: the engine's physical pages, refcounted (shared by all instances)
- exports.py        ExportRegistry: pages published under a name, per tenant
- instance_pages.py InstancePages: the page table of one instance: its local page / sequence ids ->
                    physical pages, the WIT kv operations, the reference discipline (pins,
                    deferred release, reclaim, quota) and `prepare`, the translation of a forward
                    pass to physical pages (copy-on-write, hidden slots; a decode step's route)
- masks.py          attention masks in their one encoding (run-length rows) and hidden slots
- contention.py     the contention policy: victims when the pool is dry, the restore order
- swap.py           SwapSpace: host bytes of suspended instances' pages, bounded, per tenant

May import: engine.batch (request types), host.errors, host.scheduling.work. Never the sandbox,
the bindings or the scheduler itself.
"""
from host.kv.allocator import PageAllocator, PageStats
from host.kv.exports import ExportInfo, ExportRegistry
from host.kv.instance_pages import InstancePages

__all__ = ["PageAllocator", "PageStats", "ExportRegistry", "ExportInfo", "InstancePages"]
