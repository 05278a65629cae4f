"""`HostKVPool`: K/V pages kept in host memory, and the links that copy them to and from a device.

The host pool mirrors a device `MHAKVCache` page for page (same layers, page size, heads,
head_dim and dtype) but stores each page contiguously, page-major: ``(num_pages, 2, num_layers,
page_size, local_kv_heads, head_dim)``, so that one page is one run of bytes to copy. When the
device pool is on CUDA the buffer is pinned (page-locked), which a DMA engine can read and write
without a staging copy, as SGLang's host pool and vLLM's CPU offloading allocate theirs.

`HostLink` names a copy bandwidth between host and device, with where the number comes from, so
that a simulated run can charge ``bytes / bytes_per_s`` seconds for the copies it makes.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np
import torch

from .._validate import check_dense, check_positive_int
from ..storage.mha_pool import MHAKVCache

__all__ = ["HostLink", "PCIE4_X16", "PCIE5_X16", "NVLINK_C2C", "HostKVPool"]


class HostLink(NamedTuple):
    """A host <-> device link: ``bytes_per_s`` in one direction, and the source of the figure."""

    name: str
    bytes_per_s: float
    source: str

    def seconds(self, num_bytes: int) -> float:
        """Seconds to move ``num_bytes`` (a real number >= 0) over the link at its full rate (no
        overlap, no latency). ``ValueError`` when the link's ``bytes_per_s`` is not > 0."""
        n: object = num_bytes  # checked as any object: callers pass what they have
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Real):
            raise TypeError(f"num_bytes must be a number, got {type(n).__name__}")
        if not float(n) >= 0:
            raise ValueError(f"num_bytes must be >= 0, got {n}")
        rate: object = self.bytes_per_s
        ok = isinstance(rate, numbers.Real) and not isinstance(rate, (bool, np.bool_))
        if not ok or not float(rate) > 0:  # type: ignore[arg-type]
            raise ValueError(f"{self.name}: bytes_per_s must be a number > 0, got {rate!r}")
        return float(n) / float(rate)  # type: ignore[arg-type]


#: PCIe 4.0 x16: 16 GT/s per lane * 16 lanes * 128b/130b encoding / 8 = 31.5 GB/s per direction.
PCIE4_X16 = HostLink(
    "PCIe 4.0 x16", 16e9 * 16 * 128 / 130 / 8, "PCI-SIG PCIe 4.0 spec: 16 GT/s/lane, 128b/130b"
)
#: PCIe 5.0 x16 (the H100 SXM's host link): 32 GT/s per lane, 63.0 GB/s per direction.
PCIE5_X16 = HostLink(
    "PCIe 5.0 x16", 32e9 * 16 * 128 / 130 / 8, "PCI-SIG PCIe 5.0 spec: 32 GT/s/lane, 128b/130b"
)
#: NVLink-C2C between Grace and Hopper on a GH200: 900 GB/s total, 450 GB/s per direction.
NVLINK_C2C = HostLink("NVLink-C2C (GH200)", 450e9, "NVIDIA GH200 datasheet: 900 GB/s bidirectional")


class HostKVPool:
    """``num_pages`` host pages shaped like the pages of ``like`` (a device `MHAKVCache`).

    Args:
        like: the device pool whose pages this one holds copies of.
        num_pages: host pages, >= 1 (usually several times the device pool's).
        pin_memory: page-lock the buffer; default: when ``like`` lives on CUDA.

    ``save`` copies device pages into host pages, ``read`` gathers host pages into one
    contiguous tensor (the staging buffer of a load), ``write`` puts such a tensor back into host
    pages and ``restore`` writes it into device pages. Every call checks all its arguments before
    it copies anything, and writes its destination in one step at the end: a call that raises
    has written nothing.
    """

    def __init__(self, like: MHAKVCache, num_pages: int, *, pin_memory: bool | None = None) -> None:
        if not isinstance(like, MHAKVCache):
            raise TypeError(f"like must be an MHAKVCache, got {type(like).__name__}")
        num_pages = check_positive_int(num_pages, "num_pages")
        page_numel = 2 * like.num_layers * like.page_size * like.local_kv_heads * like.head_dim
        if num_pages * page_numel * like.dtype.itemsize > 2**63 - 1:
            raise ValueError(
                f"num_pages={num_pages} host pages of {page_numel} elements each do not fit in one "
                "tensor (2**63 - 1 bytes)"
            )
        if pin_memory is None:
            pin_memory = like.device.type == "cuda"
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool or None, got {type(pin_memory).__name__}")
        self.num_pages, self.page_size = num_pages, like.page_size
        self.num_layers = like.num_layers
        self.page_shape = (2, like.num_layers, like.page_size, like.local_kv_heads, like.head_dim)
        self.buffer = torch.zeros(
            (num_pages, *self.page_shape), dtype=like.dtype, pin_memory=pin_memory
        )
        self.pinned = pin_memory

    @property
    def page_bytes(self) -> int:
        """Bytes one page holds (K and V of every layer)."""
        return self.buffer[0].numel() * self.buffer.element_size()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def _check(self, pages: torch.Tensor, name: str, limit: int) -> torch.Tensor:
        if (
            not isinstance(pages, torch.Tensor)
            or pages.ndim != 1
            or pages.is_floating_point()
            or pages.is_complex()
            or pages.dtype == torch.bool
        ):
            raise TypeError(f"{name} must be a 1-D integer tensor, got {pages!r:.80}")
        check_dense(pages, name)
        if pages.is_meta:
            raise ValueError(f"{name} must hold values, got a tensor on the meta device")
        p = pages.to("cpu", torch.int64)
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= limit):
            raise ValueError(f"{name} must lie in [0, {limit}), got {p.tolist()}")
        return p

    def _check_like(self, device: object) -> None:
        """``device`` must be an `MHAKVCache` whose pages this pool's pages are shaped like."""
        if not isinstance(device, MHAKVCache):
            raise TypeError(f"device must be an MHAKVCache, got {type(device).__name__}")
        shape = (2, device.num_layers, device.page_size, device.local_kv_heads, device.head_dim)
        if shape != self.page_shape or device.dtype != self.buffer.dtype:
            raise ValueError(
                f"device's pages are {shape} of {device.dtype}; this host pool holds pages "
                f"{self.page_shape} of {self.buffer.dtype}"
            )

    def _check_staged(self, staged: object, n: int) -> torch.Tensor:
        """``staged`` must be what `read` returns for ``n`` pages: ``(n, *page_shape)``, this
        pool's dtype, dense."""
        if not isinstance(staged, torch.Tensor):
            raise TypeError(f"staged must be a torch.Tensor, got {type(staged).__name__}")
        check_dense(staged, "staged")
        if staged.dtype != self.buffer.dtype:
            raise ValueError(f"staged must have dtype {self.buffer.dtype}, got {staged.dtype}")
        if staged.shape != (n, *self.page_shape):
            raise ValueError(
                f"staged must have shape {(n, *self.page_shape)}, got {tuple(staged.shape)}"
            )
        return staged

    def read(self, host_pages: torch.Tensor) -> torch.Tensor:
        """A copy of ``host_pages``: ``(n, 2, num_layers, page_size, heads, head_dim)`` on the CPU."""
        return self.buffer.index_select(0, self._check(host_pages, "host_pages", self.num_pages))

    def write(self, host_pages: torch.Tensor, staged: torch.Tensor) -> None:
        """Put ``staged`` (from `read`) back into ``host_pages``: the inverse of `read`."""
        hp = self._check(host_pages, "host_pages", self.num_pages)
        self.buffer[hp] = self._check_staged(staged, hp.numel()).to("cpu")

    def save(
        self, device: MHAKVCache, device_pages: torch.Tensor, host_pages: torch.Tensor
    ) -> None:
        """Copy device page ``device_pages[i]`` of every layer into host page ``host_pages[i]``.

        The pages are gathered on the device first and land in the host buffer in one
        assignment, so a failure before it leaves every host page as it was."""
        self._check_like(device)
        hp = self._check(host_pages, "host_pages", self.num_pages)
        dp = self._check(device_pages, "device_pages", device.num_pages)
        if hp.shape != dp.shape:
            raise ValueError(f"{dp.numel()} device pages for {hp.numel()} host pages")
        if not hp.numel():
            return
        dp = dp.to(device.device)
        # (2, layers, n, ps, heads, dim) gathered on the device, then one copy to the host.
        kv = torch.stack(
            [
                torch.stack([device.k_cache(layer)[dp], device.v_cache(layer)[dp]])
                for layer in range(self.num_layers)
            ],
            dim=1,
        )
        self.buffer[hp] = kv.permute(2, 0, 1, 3, 4, 5).to("cpu")

    def restore(self, device: MHAKVCache, device_pages: torch.Tensor, staged: torch.Tensor) -> None:
        """Write ``staged`` (from `read`) into ``device_pages`` of ``device``, every layer.

        The pages written are ones the caller has just taken and not yet handed to anyone: a
        failure part way leaves only those pages partly written."""
        self._check_like(device)
        dp = self._check(device_pages, "device_pages", device.num_pages)
        self._check_staged(staged, dp.numel())
        if not dp.numel():
            return
        dp = dp.to(device.device)
        on_dev = staged.to(device.device)  # synchronous: the caller reuses its buffers at once
        for layer in range(self.num_layers):
            device.k_cache(layer)[dp] = on_dev[:, 0, layer]
            device.v_cache(layer)[dp] = on_dev[:, 1, layer]
