"""PackBinding: a PackProgram bound to fixed tensors and one buffer (the refit loop's hot path)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import _triton_backend
from .reference import cast_copy, copy_reference

__all__ = ["PackBinding"]


class PackBinding:
    """A program bound to fixed tensors and one buffer: the hot path of a refit loop.

    Keeps references to the tensors and the buffer, so their addresses stay valid while bound.
    Each direction is worked out once (what runs, with which pointers): on CUDA a call is
    one launch of the compiled kernel straight through Triton's launcher once the first call
    compiled it (``kernels._triton_backend``), a few microseconds of host time.
    """

    __slots__ = ("_graphs", "_launches", "_runs", "buf", "cuda_graph", "program", "tensors")

    def __init__(
        self,
        program: Any,  # the PackProgram (kernels.program imports this module)
        tensors: tuple[torch.Tensor, ...],
        buf: torch.Tensor,
        cuda_graph: bool = False,
    ):
        self.program = program
        self.tensors = tensors
        self.buf = buf
        self.cuda_graph = cuda_graph
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        plan = program._plan
        if plan is not None and plan.num_tiles:
            desc = program._resolved(tensors, buf)
            self._launches = {
                pack: _triton_backend.BoundLaunch(buf=buf, desc=desc, tile_region=plan.tile_region,
                                                  num_tiles=plan.num_tiles, pack=pack,
                                                  tile_bytes=program.tile_bytes, num_warps=program.num_warps)
                for pack in (True, False)
            }
        else:
            self._launches = {}
        self._runs = {pack: self._direction(pack) for pack in (True, False)}

    def pack(self) -> torch.Tensor:
        """Pack the bound tensors into the bound buffer; returns the buffer."""
        self._runs[True]()
        return self.buf

    def unpack(self) -> None:
        """Unpack the bound buffer into the bound tensors."""
        p = self.program
        if p._unpack_conflict is not None:
            raise ValueError(f"cannot unpack: {p._unpack_conflict}")
        self._runs[False]()

    def _direction(self, pack: bool) -> Callable[[], None]:
        """What one direction runs, as one callable: the Triton launch (or its graph), the
        torch reference, and the casting copies, whichever apply."""
        p = self.program
        steps: list[Callable[[], None]] = []
        if p._plan is None:
            steps.append(functools.partial(copy_reference, p._byte_regions, self.tensors, self.buf, pack=pack))
        elif self._launches:
            steps.append(functools.partial(self._run, pack) if self.cuda_graph else self._launches[pack])
        if p._cast_regions:
            steps.append(functools.partial(cast_copy, p._cast_regions, self.tensors, self.buf, p.packed_dtypes,
                                           pack=pack))
        if len(steps) == 1:
            return steps[0]

        def run_all() -> None:
            for step in steps:
                step()

        return run_all

    def _run(self, pack: bool) -> None:
        """``cuda_graph=True``: the first call launches (compiling) and captures the launch,
        later calls replay the graph on the current stream."""
        graph = self._graphs.get(pack)
        if graph is None:
            # The first launch compiles (outside the capture); it also does this call's work.
            self._launches[pack]()
            side = torch.cuda.Stream(self.buf.device)
            side.wait_stream(torch.cuda.current_stream(self.buf.device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                self._launches[pack]()
            torch.cuda.current_stream(self.buf.device).wait_stream(side)
            self._graphs[pack] = graph
            return
        graph.replay()
