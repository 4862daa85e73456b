"""The HSMLA layer: multi-scale ReLU linear attention plus gated local softmax refinement."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from hsmla_med.nn import functional as HF
from hsmla_med.nn.conv import conv_type
from hsmla_med.nn.dispatch import BACKENDS, BackendChoice, select_backend

__all__ = ["HSMLA", "ROUTING_MODES", "BACKENDS", "calibrate_tau"]

#: ``gate``: learned routing (soft in training, hard at inference); ``off``: linear attention
#: only (the paper's "MSLA only" ablation); ``all``: local refinement everywhere (alpha = 1).
ROUTING_MODES = ("gate", "off", "all")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return value


def _finite(name: str, value, positive: bool = False) -> float:
    """``value`` as a float; a NaN ``tau`` would switch the refinement off without a word
    (no gate is ``> nan``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a {'positive ' if positive else ''}finite number, got {value!r}.")
    return float(value)


class HSMLA(nn.Module):
    """Hierarchical Softmax Multi-scale Linear Attention over a ``(batch, C, *spatial)`` map.

    Computes docs/design.md §2: a 1x1 projection to ``Q, K, V``; multi-scale depthwise tokens
    ``Qh, Kh, Vh`` (sum over ``scales``); global ReLU linear attention for every token; a
    hierarchical head -> block gate ``M`` over ``block``-sized tiles; and the local residual
    ``R = O_loc - O_linloc`` over a ``window``-sized neighbourhood. Training mixes
    ``O_lin + M * R`` (differentiable); inference adds ``M * R`` only on tiles with ``M > tau``,
    computing ``R`` for those tiles alone (the training weight ``M`` is kept on active tiles,
    a deliberate deviation from the paper's ``[M > tau] * R``, docs/design.md §2.10: see ``forward``). A 1x1
    projection maps back to ``in_channels``.

    After each forward the layer keeps ``last_gate`` (``(batch, *tiles)``, ``None`` unless
    routing is ``"gate"``) and ``last_alpha`` (fraction of tiles refined, or that would be at
    ``tau`` in training).

    Args:
        spatial_dims: 2 or 3.
        in_channels: channels ``C`` of the input and output.
        head_dim: channels per head ``d``; ``C`` must be a multiple (``heads = C // d``).
        scales: odd depthwise kernel sizes summed into the multi-scale tokens.
        window: odd local window size per axis.
        block: gate tile size per axis (edge tiles may be partial).
        tau: inference threshold on the block gate (a buffer, saved in checkpoints).
        rho: target mean gate of the budget regulariser.
        eps: linear-attention denominator term.
        routing: one of :data:`ROUTING_MODES`.
        backend: one of :data:`BACKENDS`; each call's choice is made by
            :func:`~hsmla_med.nn.dispatch.select_backend` (a forced kernel backend that cannot
            run raises).

    :meth:`calibrate` sets ``tau`` from a batch of the layer's inputs; :func:`calibrate_tau`
    does it for every gated layer of a network.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        head_dim: int = 32,
        scales: Sequence[int] = (3, 5, 7),
        window: int = 7,
        block: int = 4,
        tau: float = 0.15,
        rho: float = 0.3,
        eps: float = HF.DEFAULT_EPS,
        routing: str = "gate",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if spatial_dims not in (2, 3):
            raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims!r}.")
        _positive_int("in_channels", in_channels)
        _positive_int("head_dim", head_dim)
        if in_channels % head_dim:
            raise ValueError(f"in_channels ({in_channels}) must be a multiple of head_dim ({head_dim}).")
        _positive_int("window", window)
        if window % 2 == 0:
            raise ValueError(f"window must be odd so that it is centred on the query, got {window}.")
        _positive_int("block", block)
        scales = tuple(scales)
        if not scales or any(isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % 2 == 0 for k in scales):
            raise ValueError(f"scales must be a non-empty sequence of positive odd kernel sizes, got {scales!r}.")
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"rho must lie in [0, 1], got {rho!r}.")
        _finite("tau", tau)
        _finite("eps", eps, positive=True)
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.head_dim = head_dim
        self.heads = in_channels // head_dim
        self.scales = scales
        self.window = window
        self.block = block
        self.rho = float(rho)
        self.eps = float(eps)
        self.routing = routing
        self.backend = backend
        self.register_buffer("tau", torch.tensor(float(tau)))

        conv = conv_type(spatial_dims)
        c3 = 3 * in_channels
        self.qkv = conv(in_channels, c3, kernel_size=1, bias=False)
        self.multiscale = nn.ModuleList(conv(c3, c3, k, padding=k // 2, groups=c3) for k in scales)
        self.gate_conv = conv(c3, c3, 3, padding=1, groups=c3)
        # Per-head gate projection w_h over that head's [Qh; Kh; Vh] channels, and bias b_h.
        self.gate_weight = nn.Parameter(torch.randn(3, self.heads, head_dim) * (3 * head_dim) ** -0.5)
        self.gate_bias = nn.Parameter(torch.zeros(self.heads))
        self.proj = conv(in_channels, in_channels, kernel_size=1)
        self.last_gate: torch.Tensor | None = None
        self._alpha = 0.0  # last_alpha without a gate
        self._gate_tau: torch.Tensor | None = None  # the last gate's tau if calibrate changed it since
        self._derived_cache: dict[str, tuple] = {}  # see _derived

    # -- settings -----------------------------------------------------------------------------
    @property
    def routing(self) -> str:
        return self._routing

    @routing.setter
    def routing(self, mode: str) -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {ROUTING_MODES}, got {mode!r}.")
        self._routing = mode

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}.")
        self._backend = name

    # -- pieces -------------------------------------------------------------------------------
    def _multiscale(self, qkv: torch.Tensor) -> torch.Tensor:
        # A sum of 'same'-padded depthwise convolutions equals one convolution with the summed,
        # centre-aligned kernels: one pass over the map instead of len(scales).
        size = max(self.scales)
        # Along an axis of n tokens, a 'same' convolution reaches at most n - 1 tokens either
        # side: the kernel's outer taps only ever meet padding. Cropping them is exact and
        # matters at the deep stages of 3D patches (a 4 x 6 x 2 map under a 7^3 kernel: 105 of
        # 343 taps), where the full kernel's backward cost a 3D training step ~100 ms
        # (docs/benchmarks.md, "3D training step"). Not while tracing or exporting: the crop
        # depends on the map's size, which a traced graph would fix at the example's.
        tracing = HF.building_graph() or torch.jit.is_scripting()
        taps = tuple(size if tracing else min(size, 2 * n - 1) for n in qkv.shape[2:])
        sources = tuple(t for c in self.multiscale for t in (c.weight, c.bias))
        weight, bias = self._derived(f"multiscale{taps}", sources, lambda: self._merged_multiscale(taps))
        conv = (F.conv2d, F.conv3d)[self.spatial_dims - 2]
        return conv(qkv, weight, bias, padding=[t // 2 for t in taps], groups=qkv.shape[1])

    def _merged_multiscale(self, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed, centre-aligned kernels of the scales, cropped to ``taps`` per axis, and
        the summed biases (kept by :meth:`_derived`: rebuilding them cost 9 launches a call)."""
        size = max(self.scales)
        weight = sum(
            F.pad(c.weight, [(size - c.kernel_size[0]) // 2] * (2 * self.spatial_dims)) for c in self.multiscale
        )
        weight = weight[(..., *(slice((size - t) // 2, (size + t) // 2) for t in taps))]
        return weight, sum(c.bias for c in self.multiscale)

    def _split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(b, 3C, *S)`` -> three ``(b, heads, *S, d)`` views."""
        b, spatial = x.shape[0], x.shape[2:]
        x = x.view(b, 3, self.heads, self.head_dim, *spatial).movedim(3, -1)
        return x.unbind(1)

    def gate(self, ms: torch.Tensor) -> torch.Tensor:
        """Block gate ``M`` of shape ``(batch, *tiles)`` from the multi-scale tokens ``(b, 3C, *S)``.

        ``G^h_b = sigmoid(w_h . AvgPool_b(DWConv3x3([Qh_h; Kh_h; Vh_h])) + b_h)``,
        ``M_b = mean_h G^h_b``. On the ``cpu`` backend the C gate computes it for maps of whole
        tiles, the PyTorch gate for the others.
        """
        block_gate = self._select(ms).gate_op()
        if block_gate is not None:
            taps = self._derived(
                "gate_taps", self.gate_conv.weight, lambda: self._gate_pool_kernel().flatten(1).t().contiguous()
            )
            gate = block_gate(ms, taps, self.gate_conv.bias, self.gate_weight, self.gate_bias, self.block)
            if gate is not None:
                return gate
        pooled = self._gate_pool(ms)  # (b, 3C, *tiles)
        rows = pooled.flatten(2).transpose(1, 2)  # (b, tiles, 3C): contiguous rows when channels-last
        # one matrix product with the bias (addmm): every head's logit at once
        logits = F.linear(rows, self._derived("gate_matrix", self.gate_weight, lambda: self._gate_matrix().t()), self.gate_bias)
        return logits.sigmoid_().mean(dim=-1).view(pooled.shape[0], *pooled.shape[2:])

    def _gate_matrix(self) -> torch.Tensor:
        """The per-head projections ``w_h`` as one block matrix ``(3C, heads)``: row ``(t, h, i)``
        holds ``w_h[t, i]`` in column ``h``, so that one matrix product gives every head's logit
        (an ``einsum`` over the pooled map's head views cost more than the pooling)."""
        eye = self.gate_weight.new_ones(self.heads).diag()  # not torch.eye(device=...): a trace would fix its device
        return (self.gate_weight.unsqueeze(-1) * eye.view(1, self.heads, 1, self.heads)).reshape(-1, self.heads)

    def _gate_pool(self, ms: torch.Tensor) -> torch.Tensor:
        """``AvgPool_b(DWConv3x3(ms))``, ``(b, 3C, *tiles)``.

        Both are linear, so on a map made of whole tiles they are one depthwise convolution
        with stride ``block`` whose kernel is the 3x3 kernel convolved with a ``block``-sized box
        (divided by its volume): it never materialises the full-resolution conv output, which
        costs as much as the Q/K/V projection on large maps. Maps with partial edge tiles average
        over the tokens that exist, on the unfused path: one ``avg_pool`` with ``ceil_mode``,
        whose edge windows divide by the tokens inside the map (two operations where
        :func:`~hsmla_med.nn.functional.tile_average` takes seven), and
        :func:`~hsmla_med.nn.functional.tile_average` itself while a graph is recorded for export
        (symbolic sizes: one graph for whole and partial tiles; ``ceil_mode`` would fix the tile
        count) or where a side is shorter than a tile (which ``avg_pool3d`` refuses).
        """
        conv = self.gate_conv
        if any(isinstance(n, torch.SymInt) or n % self.block for n in ms.shape[2:]):
            if HF.building_graph() or torch.compiler.is_exporting() or any(n < self.block for n in ms.shape[2:]):
                return HF.tile_average(conv(ms), self.block)
            pool = (F.avg_pool2d, F.avg_pool3d)[self.spatial_dims - 2]
            return pool(conv(ms), self.block, stride=self.block, ceil_mode=True)
        conv_nd = (F.conv2d, F.conv3d)[self.spatial_dims - 2]
        kernel = self._derived("gate_pool", conv.weight, self._gate_pool_kernel)
        return conv_nd(ms, kernel, conv.bias, stride=self.block, padding=1, groups=ms.shape[1])

    def _gate_pool_kernel(self) -> torch.Tensor:
        """The fused kernel ``(3C, 1, *[block + 2])``: the 3x3 kernels fully convolved with the
        ``block`` box (sums of shifted copies along each axis), divided by its volume.
        (Kept between calls by :meth:`_derived`: a new kernel tensor on every call costs oneDNN
        a weight reorder, several times the strided convolution itself on small maps.)"""
        weight, b, dims = self.gate_conv.weight, self.block, self.spatial_dims
        kernel = F.pad(weight, [b - 1] * (2 * dims))
        for axis in range(2, 2 + dims):
            kernel = sum(kernel.narrow(axis, i, kernel.shape[axis] - b + 1) for i in range(b))
        return kernel / b**dims

    def _derived(self, slot: str, weights: torch.Tensor | tuple[torch.Tensor, ...], build):
        """``build()``, derived from ``weights`` (a tensor or a tuple); without gradients it is
        kept until a weight changes (its version counter, storage or dtype: an optimizer step,
        loaded weights, a cast), so that it is built once, before a CUDA graph captures the
        forward. While a tracer records (:func:`building_graph`), it is built in the graph: the
        fake tensors of ``torch.compile`` and ``torch.export`` have no storage to key on, and
        ``torch.jit.trace`` would store a kept tensor as a constant."""
        weights = weights if isinstance(weights, tuple) else (weights,)
        if HF.building_graph() or (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
            return build()
        key = tuple((w._version, w.data_ptr(), w.dtype) for w in weights)
        kept = self._derived_cache.get(slot)
        if kept is None or kept[0] != key:
            kept = self._derived_cache[slot] = (key, build())
        return kept[1]

    def _select(self, *maps: torch.Tensor) -> BackendChoice:
        """The backend of a call on the layer's ``(b, 3C, *S)`` maps (:func:`select_backend`)."""
        ref = maps[0]
        shape = ref.shape
        features = (shape[0], self.heads, *shape[2:], self.head_dim)
        grad = torch.is_grad_enabled() and any(m.requires_grad for m in maps)
        channels_last = all(m.stride(1) == 1 for m in maps)  # head_dim contiguous in the head views
        return select_backend(self.backend, self.training, ref.device, ref.dtype, features, grad=grad, channels_last=channels_last)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != self.spatial_dims + 2:
            raise ValueError(
                f"HSMLA with spatial_dims={self.spatial_dims} expects input (batch, C, "
                f"{'D, ' if self.spatial_dims == 3 else ''}H, W), got shape {tuple(x.shape)}."
            )
        if x.shape[1] != self.in_channels:
            raise ValueError(f"input has {x.shape[1]} channels, in_channels is {self.in_channels}.")

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor, target_alpha: float = 0.3) -> float:
        """Set ``tau`` to the ``1 - target_alpha`` quantile of the block gate of ``x`` (a batch of
        this layer's inputs), so that about ``target_alpha`` of its tiles refine; returns it.

        Computes the gate alone (the projections, the multi-scale tokens, the gate) with the
        backend a forward in the current mode would use, and changes nothing but ``tau``.
        """
        if not 0.0 <= target_alpha <= 1.0:
            raise ValueError(f"target_alpha must lie in [0, 1], got {target_alpha!r}.")
        self._check_input(x)
        gate = self.gate(self._multiscale(self.qkv(x)))
        tau = torch.quantile(gate.float().flatten(), 1.0 - target_alpha).item()
        if self.last_gate is not None and self._gate_tau is None:
            self._gate_tau = self.tau.detach().clone()  # last_alpha of the earlier forward: its tau
        self.tau.fill_(tau)
        return tau

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, in_channels, *spatial)`` -> same shape.

        Nothing here reads a tensor's value on the host or sizes a tensor from one (no
        ``nonzero``, ``item``, ``tolist``): on CUDA a forward is a fixed sequence of launches that
        a CUDA graph replays for any input (docs/design.md §4).
        """
        self._check_input(x)
        spatial = x.shape[2:]
        qkv = self.qkv(x)
        ms = self._multiscale(qkv)
        q, k, v = self._split_heads(qkv)
        qh, kh, vh = self._split_heads(ms)
        choice = self._select(qkv, ms)
        # The gate first, while the multi-scale map it pools is still in cache.
        gate = self.gate(ms) if self.routing == "gate" else None
        # The gate of this forward for gate_stats and the regularisers: a tensor the forward made
        # (under a CUDA graph, the graph's own output, which each replay refills); compared with
        # the tau buffer when asked for (calibrate keeps the tau it replaces for an older gate).
        if not torch.compiler.is_exporting():  # export would leave its fake tensors here
            self.last_gate, self._gate_tau = gate, None
        self._alpha = 1.0 if self.routing == "all" else 0.0

        if self.training and self.routing != "off":
            out = HF.linear_attention(qh, kh, vh, self.eps)
            r = self._refine_everywhere(choice, q, k, v, qh, kh, vh)
            if gate is None:
                out = out + r
            else:
                # Active tiles keep the gate weight they had in training (the paper adds R at
                # weight 1): the budget keeps M near rho, so a network trained on M * R saw R at
                # about 0.3, and full-weight R at inference cost 7 Dice points on BTCV
                # (docs/benchmarks.md); inference adds M * R on the tiles with M > tau.
                weight = HF.tile_broadcast(gate, self.block, tuple(spatial)).unsqueeze(1).unsqueeze(-1)
                out = torch.addcmul(out, weight.to(r.dtype), r)
        else:
            # tau as the 0-d buffer, not float(self.tau): tracing, torch.export and torch.compile
            # keep it in the graph, and on CUDA the kernel reads it where it lies
            out = choice.attend()(q, k, v, qh, kh, vh, gate, self.tau, self.routing != "off", self.block, self.window, self.eps)

        out = out.movedim(-1, 2).reshape(x.shape[0], self.in_channels, *spatial)
        return self.proj(out.to(x.dtype))

    def _refine_everywhere(self, choice: BackendChoice, q, k, v, qh, kh, vh) -> torch.Tensor:
        """``R`` for every token in training: :func:`~hsmla_med.nn.functional.dense_refine` on
        maps small enough for :func:`~hsmla_med.nn.functional.dense_fits` (the same values, a
        fraction of the time forward and backward, docs/benchmarks.md), else
        :func:`~hsmla_med.nn.functional.window_refine`, every tile's window attention in a few
        batched operations: no loop over tiles and no host sync at any size."""
        if choice.dense:
            return HF.dense_refine(q, k, v, qh, kh, vh, self.window, self.eps)
        return HF.window_refine(q, k, v, qh, kh, vh, self.block, self.window, self.eps)

    @property
    def last_alpha(self) -> float:
        """Fraction of tiles refined by the last forward (with a gate: tiles above the tau of
        that forward). Counted when asked for rather than in every forward (a host read)."""
        refined = self.refined_tiles()
        return self._alpha if refined is None else float(refined.float().mean())

    def refined_tiles(self) -> torch.Tensor | None:
        """``(batch, *tiles)`` bool: the tiles the last forward's gate refined (on the gate's
        device, read on the host by nobody here: counting them over many forwards costs one
        host read in the end); ``None`` without a gate."""
        if self.last_gate is None:
            return None
        tau = self.tau if self._gate_tau is None else self._gate_tau
        return self.last_gate.detach() > tau

    def regularizers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(budget, smoothness) of the last forward's gate; zeros when no gate was computed."""
        if self.last_gate is None:
            zero = self.tau.new_zeros(())
            return zero, zero
        return HF.gate_regularizers(self.last_gate, self.rho)

    def extra_repr(self) -> str:
        return (
            f"spatial_dims={self.spatial_dims}, in_channels={self.in_channels}, heads={self.heads}, "
            f"head_dim={self.head_dim}, scales={self.scales}, window={self.window}, block={self.block}, "
            f"tau={float(self.tau):.4g}, rho={self.rho}, routing={self.routing!r}, backend={self.backend!r}"
        )


@torch.no_grad()
def calibrate_tau(model: nn.Module, samples: torch.Tensor | Iterable[torch.Tensor], target_alpha: float = 0.3) -> dict[str, float]:
    """Set every gated HSMLA layer's ``tau`` so that about ``target_alpha`` of its tiles refine.

    One inference forward over the samples (a batch tensor, or equally shaped tensors that are
    concatenated into one), in which each gated layer, in execution order, first calibrates on
    its own input (:meth:`HSMLA.calibrate`: ``tau`` is the ``1 - target_alpha`` quantile of its
    gate values) and then runs with that ``tau``: later layers are calibrated on the inputs that
    the already calibrated earlier layers produce. The calibration runs from hooks held for this
    pass only; afterwards nothing but the ``tau`` buffers has changed (each module's
    training mode is restored), and a later forward equals that of a network loaded with these
    ``tau`` values. ``model`` may be a network or a single HSMLA layer.

    Returns:
        ``{layer name: tau}``.
    """
    if not 0.0 <= target_alpha <= 1.0:
        raise ValueError(f"target_alpha must lie in [0, 1], got {target_alpha!r}.")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, HSMLA) and m.routing == "gate"}
    if not layers:
        return {}
    batch = samples if isinstance(samples, torch.Tensor) else torch.cat(list(samples))

    def calibrate(layer: HSMLA, args: tuple, kwargs: dict) -> None:
        layer.calibrate(args[0] if args else kwargs["x"], target_alpha)

    modes = {m: m.training for m in model.modules()}
    model.eval()
    hooks = [layer.register_forward_pre_hook(calibrate, with_kwargs=True) for layer in layers.values()]
    try:
        model(batch)
    finally:
        for hook in hooks:
            hook.remove()
        for module, mode in modes.items():
            module.training = mode
    return {n: float(m.tau) for n, m in layers.items()}
