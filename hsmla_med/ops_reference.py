"""The reference math of the HSMLA attention ops that the kernels compute (docs/design.md §2),
in plain PyTorch, 2D and 3D.

Every tensor of attention features has the layout ``(batch, heads, *spatial, head_dim)`` with
``spatial = (H, W)`` or ``(D, H, W)``. Each kernel of :mod:`hsmla_med.kernels` is tested against
the function of its name here and runs it for inputs it does not take; the
:class:`~hsmla_med.nn.HSMLA` layer runs them on its ``reference`` backend
(:mod:`hsmla_med.nn.functional` imports them, beside the forms that training and export take).
They sit below both packages so that the kernels need nothing of the networks, which choose a
kernel per call (:mod:`hsmla_med.nn.dispatch`): every import runs from the networks down.

The local window terms are evaluated per spatial *tile*: the map is cut into non-overlapping
``block``-sized tiles, each tile's queries attend to a halo of ``block + window - 1`` keys per
axis with a fixed band mask selecting each query's own ``window``-sized neighbourhood. This is
the paper's tile-compacted schedule; it makes the work proportional to the number of tiles
processed, so the inference path can evaluate only the tiles that the gate selects while the
full-map functions below are the same computation over every tile.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

__all__ = [
    "linear_attention",
    "local_attention",
    "local_linear_attention",
    "local_refine",
    "attend",
    "tile_grid",
    "block_gate",
    "check_refine",
]

DEFAULT_EPS = 1e-6
# Tile size used by the full-map local functions; the result does not depend on it.
_FULL_MAP_BLOCK = 8
# Score bias of hidden keys: a finite minimum (not -inf) keeps the softmax rows of padded queries
# in partial edge tiles finite, and a quarter of it leaves room for any finite score. Public: the
# dense forms of hsmla_med.nn.functional hide keys with the same bias.
HIDDEN = torch.finfo(torch.float32).min / 4


def _check_features(name: str, x: torch.Tensor) -> int:
    if x.dim() not in (5, 6):
        raise ValueError(
            f"{name} must have shape (batch, heads, *spatial, head_dim) with 2 or 3 spatial dims, "
            f"got {tuple(x.shape)}."
        )
    return x.dim() - 3


def _check_window(window: int) -> None:
    if not isinstance(window, int) or window <= 0 or window % 2 == 0:
        raise ValueError(f"window must be a positive odd integer, got {window!r}.")


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive integer, got {block!r}.")


def _check_same_map(**tensors: torch.Tensor) -> None:
    shapes = {name: t.shape[:-1] for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if any(s != first for s in shapes.values()):  # no set(): symbolic sizes (export) do not hash
        raise ValueError(f"features must share (batch, heads, *spatial): {shapes}.")


def _channel_first(x: torch.Tensor) -> torch.Tensor:
    """``(b, h, *S, d)`` -> ``(b, h, d, *S)`` view.

    The HSMLA layer's features are views of channel-first maps, so in this layout the linear
    path's matrix products read memory in order and its result maps back to the channel-first
    output without a copy.
    """
    return x.movedim(-1, 2)


def _feature_view(x_cf: torch.Tensor) -> torch.Tensor:
    """``(b, h, d, *S)`` -> ``(b, h, *S, d)`` view (the public layout)."""
    return x_cf.movedim(2, -1)


def linear_attention(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, eps: float = DEFAULT_EPS
) -> torch.Tensor:
    """Global ReLU linear attention, docs/design.md §2.3.

    ``out_i = phi(qh_i) Z / (phi(qh_i) . Dn + eps)`` with ``Z = sum_j phi(kh_j)^T vh_j`` and
    ``Dn = sum_j phi(kh_j)``, ``phi = relu``, per batch element and head.

    Args:
        qh, kh, vh: multi-scale queries, keys, values, ``(batch, heads, *spatial, head_dim)``.
        eps: added to the denominator.

    Returns:
        Tensor of the shape and dtype of ``qh``. The aggregates and the division run in float32
        whatever the input dtype or autocast state (sums over N tokens overflow float16).
    """
    _check_features("qh", qh)
    _check_same_map(qh=qh, kh=kh, vh=vh)
    with torch.autocast(device_type=qh.device.type, enabled=False):
        q, k, v = (_channel_first(t).float().flatten(3) for t in (qh, kh, vh))  # (b, h, d, N)
        q, k = q.relu(), k.relu()
        z_t = v @ k.transpose(-1, -2)  # Z^T, (b, h, d, d)
        dn = k.sum(dim=-1).unsqueeze(-2)  # (b, h, 1, d)
        out = (z_t @ q) / ((dn @ q) + eps)  # (b, h, d, N)
    return _feature_view(out.view(*out.shape[:3], *qh.shape[2:-1])).to(qh.dtype)


@lru_cache(maxsize=32)
def _band_mask(spatial_dims: int, block: int, window: int) -> torch.Tensor:
    """``(block**s, (block+window-1)**s)`` bool: halo key ``u`` lies in query ``p``'s window.

    Query ``p`` sits at halo coordinate ``p + window//2``, so its window covers halo
    coordinates ``p .. p + window - 1`` on every axis.
    """
    halo = block + window - 1
    p = torch.arange(block).view(-1, 1)
    u = torch.arange(halo).view(1, -1)
    axis = (u >= p) & (u <= p + window - 1)  # (block, halo)
    mask = axis
    for _ in range(spatial_dims - 1):  # row-major outer product over the axes
        mask = (mask[:, None, :, None] & axis[None, :, None, :]).flatten(2, 3).flatten(0, 1)
    return mask


def tile_grid(spatial: tuple[int, ...], block: int) -> tuple[int, ...]:
    """Number of ``block``-sized tiles per axis (edge tiles may be partial)."""
    return tuple(math.ceil(s / block) for s in spatial)


@lru_cache(maxsize=64)
def _tile_tables(spatial: tuple[int, ...], block: int, window: int, device: torch.device):
    """Token positions of every tile of a map, computed once per map geometry.

    Returns ``(q_flat, k_flat, hidden, partial)``: ``q_flat`` ``(tiles, block**s)`` the flat map
    position of each tile's own tokens (clamped into the map), ``k_flat``
    ``(tiles, (block + window - 1)**s)`` those of its halo (out-of-map tokens clamped to an edge
    copy), ``hidden`` ``(tiles, block**s, halo**s)`` float32, the score bias that hides a halo key
    outside the query's window or outside the map (``HIDDEN``, else 0), and ``partial``
    ``(tiles, block**s)`` bool, query inside the map (``None`` when every tile is whole). Tiles
    are numbered row-major over :func:`tile_grid`.
    """
    grid = tile_grid(spatial, block)
    tiles = torch.cartesian_prod(*(torch.arange(n) for n in grid)).reshape(-1, len(grid))

    def positions(halo: int):
        size = block + 2 * halo
        offsets = torch.arange(size) - halo
        flat = torch.zeros((tiles.shape[0], 1), dtype=torch.long)
        inside = torch.ones((tiles.shape[0], 1), dtype=torch.bool)
        for axis, n in enumerate(spatial):
            coord = tiles[:, axis, None] * block + offsets  # (tiles, size)
            inside = (inside.unsqueeze(-1) & ((coord >= 0) & (coord < n)).unsqueeze(1)).flatten(1)
            flat = (flat.unsqueeze(-1) * n + coord.clamp(0, n - 1).unsqueeze(1)).flatten(1)
        return flat, inside

    q_flat, q_inside = positions(0)
    k_flat, k_inside = positions(window // 2)
    visible = _band_mask(len(spatial), block, window).unsqueeze(0) & k_inside.unsqueeze(1)
    hidden = torch.where(visible, 0.0, HIDDEN)
    partial = None if bool(q_inside.all()) else q_inside.to(device)
    return q_flat.to(device), k_flat.to(device), hidden.to(device), partial


class _TileSet:
    """Token positions of a list of tiles, looked up once for all gathers and the scatter.

    ``index``: ``(n,)`` ascending flat tile numbers ``batch * tiles + tile`` (tiles row-major
    over :func:`tile_grid`), so the tiles of each batch element form one contiguous run.
    """

    def __init__(self, index: torch.Tensor, batch: int, block: int, window: int, spatial: tuple[int, ...]) -> None:
        q_flat, k_flat, hidden, partial = _tile_tables(spatial, block, window, index.device)
        tiles = q_flat.shape[0]
        if batch == 1:  # the usual inference case: one run, no counting
            tile, self.runs = index, [(0, slice(0, index.shape[0]))]
        else:
            tile, self.runs, start = index % tiles, [], 0  # runs: (batch element, rows of index)
            for b, n in enumerate(torch.bincount(index // tiles).tolist()):
                if n:
                    self.runs.append((b, slice(start, start + n)))
                    start += n
        self.q_flat, self.k_flat = q_flat[tile], k_flat[tile]
        self.hidden = hidden[tile]  # (n, Bq, Bk)
        # Queries of partial edge tiles that fall outside the map are not written back.
        self.q_keep = None if partial is None else partial[tile]

    def _batched(self, select) -> torch.Tensor:
        parts = [select(b, r) for b, r in self.runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def gather_keys(self, x: torch.Tensor) -> torch.Tensor:
        """Halos of a token-major ``(b, P, h, N, d)`` stack of maps -> ``(P * h, n, halo, d)``
        (out-of-map tokens hold clamped edge copies; ``hidden`` hides them). Whole contiguous
        token rows are copied, and the result feeds the batched matmuls as it is.
        (``index_select`` along the middle axis of a 3D ``(P * h, N, d)`` view: on a 4D tensor
        it took three times as long.)"""
        out = self._batched(lambda b, r: x[b].flatten(0, 1).index_select(1, self.k_flat[r].flatten()))
        return out.view(x.shape[1] * x.shape[2], *self.k_flat.shape, x.shape[-1])

    def gather_queries(self, maps: list[torch.Tensor]) -> torch.Tensor:
        """The tiles' own tokens of P maps ``(b, h, *S, d)`` -> float32 ``(P * h, n, block**s, d)``.

        Read straight from the maps: only the tiles' tokens are copied (the layer's maps are
        channels-last, so each token's ``h * d`` channels are one contiguous row)."""
        b, h, d = maps[0].shape[0], maps[0].shape[1], maps[0].shape[-1]
        rows = [m.flatten(2, -2).transpose(1, 2).reshape(b, -1, h * d) for m in maps]  # (b, N, h * d)
        out = torch.stack([self._batched(lambda i, r: x[i].index_select(0, self.q_flat[r].flatten())) for x in rows])
        out = out.view(len(maps), -1, h, d).transpose(1, 2)  # (P, h, n * Bq, d)
        return out.reshape(len(maps) * h, *self.q_flat.shape, d).float()

    def scatter(self, out: torch.Tensor, r: torch.Tensor, add: bool) -> None:
        """Write, or with ``add`` add, ``(h, n, block**s, d)`` tile values into ``out``,
        ``(b, h * d, N)``, in place."""
        h, d = r.shape[0], r.shape[-1]
        values = r.permute(0, 3, 1, 2).reshape(h * d, *self.q_flat.shape).to(out.dtype)
        for b, rows in self.runs:
            flat, vals = self.q_flat[rows], values[:, rows]
            if self.q_keep is not None:
                flat, vals = flat[self.q_keep[rows]], vals[:, self.q_keep[rows]]
            write = out[b].index_add_ if add else out[b].index_copy_
            write(1, flat.flatten(), vals.reshape(h * d, -1))


def _all_tiles(shape: torch.Size, block: int, device: torch.device) -> torch.Tensor:
    """Flat numbers of every tile of every batch element (the ``index`` of :class:`_TileSet`)."""
    return torch.arange(shape[0] * math.prod(tile_grid(tuple(shape[2:-1]), block)), device=device)


def _window_attention(q, k, v, hidden, softmax_heads: int, eps: float) -> torch.Tensor:
    """Attention of tile queries ``(P * h, n, Bq, d)`` over their halo keys ``(P * h, n, Bk, d)``
    with the score bias ``hidden`` ``(n, Bq, Bk)``: masked softmax for the first
    ``softmax_heads`` batch entries, and for the rest local ReLU linear attention (``k``
    already ``phi(kh)``). ``q`` is modified in place: scaled, or passed through ``phi``.

    The two terms share one batched matmul per product and one bias addition. The linear term
    uses ``phi(qh_i) Z_N(i) = sum_{j in N(i)} (phi(qh_i) . phi(kh_j)) vh_j``: the same band as
    the softmax with unnormalised non-negative weights; its visible weights are ``>= 0`` and
    hidden ones ``< 0`` after the bias, so ``relu`` zeroes exactly the hidden ones. Its output
    rows, ``d`` wide rather than ``Bk``, are divided by the weight sums plus ``eps``. (The
    softmax stays ``softmax``: in-place ``exp_`` with a row maximum was 15% slower here.)
    """
    q[:softmax_heads].mul_(q.shape[-1] ** -0.5)
    q[softmax_heads:].relu_()
    scores = (q @ k.transpose(-1, -2)).add_(hidden)
    soft, lin = scores[:softmax_heads], scores[softmax_heads:]
    if softmax_heads:
        soft.copy_(soft.softmax(dim=-1))
    denominator = lin.relu_().sum(dim=-1, keepdim=True).add_(eps)
    out = scores @ v
    out[softmax_heads:].div_(denominator)
    return out


def _local_terms(pairs, keys: torch.Tensor, tiles: _TileSet, eps: float, softmax: bool) -> torch.Tensor:
    """``O_loc - O_linloc`` of the tiles (or the one term that ``pairs`` holds), ``(h, n,
    block**s, d)``; ``keys`` is the stack of :func:`_key_stack` (the linear term last)."""
    terms, heads = len(pairs), keys.shape[2]
    kv = tiles.gather_keys(keys)  # keys and values in one gather
    q = tiles.gather_queries([m[0] for m in pairs])
    out = _window_attention(q, kv[: terms * heads], kv[terms * heads :], tiles.hidden, heads if softmax else 0, eps)
    if terms == 1:
        return out if softmax else -out
    return out[:heads] - out[heads:]


# Tiles are evaluated in chunks of about this many gathered elements per tensor, so temporary
# memory stays bounded however large the map (the analogue of the kernel's on-chip tile buffer).
_CHUNK_ELEMENTS = 1 << 22


def _key_stack(terms: list[tuple[torch.Tensor, ...]], linear: list[bool]) -> torch.Tensor:
    """Stack the keys and values ``(b, h, *S, d)`` of P ``(q, k, v)`` terms into one
    token-major float32 ``(b, 2 * P, h, N, d)``, all keys then all values (so one gather
    serves every term). ``phi = relu`` is applied in place to the keys of ``linear`` terms,
    before the gather, because halo tiles repeat tokens."""
    out = torch.stack([m[i].flatten(2, -2) for i in (1, 2) for m in terms], dim=1).float()
    for t, flag in enumerate(linear):
        if flag:
            out[:, t].relu_()
    return out


def _tiled(softmax_maps, linear_maps, window, block, index, eps, weight=None, add_to=None) -> torch.Tensor:
    """Local terms for the tiles in ``index``, float32 ``(b, h, *S, d)``, zero elsewhere.

    ``softmax_maps`` is ``(q, k, v)`` or ``None``, ``linear_maps`` is ``(qh, kh, vh)`` or
    ``None``; with both, the result is ``O_loc - O_linloc``. ``weight`` ``(n,)`` scales each
    tile's values. With ``add_to``, a tensor of that shape whose channel-first view
    ``(b, h, d, *S)`` is contiguous, the values are added into it in place and it is returned
    (no full-size result is allocated)."""
    pairs = [m for m in (softmax_maps, linear_maps) if m is not None]
    ref = pairs[0][0]
    b, h, d = ref.shape[0], ref.shape[1], ref.shape[-1]
    spatial = tuple(ref.shape[2:-1])
    if add_to is None:
        out = torch.zeros((b, h * d, math.prod(spatial)), dtype=torch.float32, device=ref.device)
    else:
        out = _channel_first(add_to).view(b, h * d, math.prod(spatial))
    halo_tokens = (block + window - 1) ** len(spatial)
    rows = max(1, _CHUNK_ELEMENTS // (len(pairs) * h * d * halo_tokens))
    chunks = index.split(rows)
    weights = [None] * len(chunks) if weight is None else weight.float().split(rows)
    with torch.autocast(device_type=ref.device.type, enabled=False):
        # token-major float32 keys and values (b, 2P, h, N, d), laid out once for every chunk
        keys = _key_stack(pairs, [m is linear_maps for m in pairs])
        for chunk, w in zip(chunks, weights):
            tiles = _TileSet(chunk, b, block, window, spatial)
            r = _local_terms(pairs, keys, tiles, eps, softmax_maps is not None)
            if w is not None:
                r.mul_(w.view(1, -1, 1, 1))
            tiles.scatter(out, r, add_to is not None)
    return add_to if add_to is not None else _feature_view(out.view(b, h, d, *spatial))


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Softmax attention over the ``window``-sized neighbourhood centred on each query.

    docs/design.md §2.5: ``O_loc_i = softmax(q_i k_N(i)^T / sqrt(d)) v_N(i)``; keys outside the
    map are excluded from the softmax (masked), not zero-padded.

    Args:
        q, k, v: ``(batch, heads, *spatial, head_dim)``.
        window: odd window size per axis.

    Returns:
        Tensor of the shape and dtype of ``q`` (computed in float32).
    """
    _check_features("q", q)
    _check_window(window)
    _check_same_map(q=q, k=k, v=v)
    index = _all_tiles(q.shape, _FULL_MAP_BLOCK, q.device)
    return _tiled((q, k, v), None, window, _FULL_MAP_BLOCK, index, 0.0).to(q.dtype)


def local_linear_attention(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, window: int, eps: float = DEFAULT_EPS
) -> torch.Tensor:
    """ReLU linear attention restricted to the ``window``-sized neighbourhood of each query.

    docs/design.md §2.5: ``phi(qh_i) Z_N(i) / (phi(qh_i) . Dn_N(i) + eps)`` with the sums over
    keys inside both the window and the map.

    Returns:
        Tensor of the shape and dtype of ``qh`` (computed in float32).
    """
    _check_features("qh", qh)
    _check_window(window)
    _check_same_map(qh=qh, kh=kh, vh=vh)
    index = _all_tiles(qh.shape, _FULL_MAP_BLOCK, qh.device)
    return (-_tiled(None, (qh, kh, vh), window, _FULL_MAP_BLOCK, index, eps)).to(qh.dtype)


def check_refine(maps, gate: torch.Tensor | None, block: int, window: int, add_to: torch.Tensor | None) -> int:
    """The arguments of :func:`local_refine` (and of the kernels' versions); returns the
    number of spatial dims."""
    spatial_dims = _check_features("q", maps[0])
    _check_window(window)
    _check_block(block)
    _check_same_map(**dict(zip(("q", "k", "v", "qh", "kh", "vh"), maps)))
    q = maps[0]
    if gate is not None:
        expected = (q.shape[0], *tile_grid(tuple(q.shape[2:-1]), block))
        if tuple(gate.shape) != expected:
            raise ValueError(f"gate must have shape {expected} (batch, *tiles), got {tuple(gate.shape)}.")
    if add_to is not None:
        if gate is None:
            raise ValueError("add_to needs a gate: it receives gate * R.")
        if add_to.shape != q.shape:
            raise ValueError(f"add_to must have q's shape {tuple(q.shape)}, got {tuple(add_to.shape)}.")
    return spatial_dims


def local_refine(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    gate: torch.Tensor | None,
    tau: float,
    block: int,
    window: int,
    eps: float = DEFAULT_EPS,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """Local residual ``R = O_loc - O_linloc`` on the tiles whose gate exceeds ``tau``.

    docs/design.md §2.5-2.6: the active tiles are compacted into a dense list, gathered with a
    halo of ``window // 2``, evaluated, and scattered back; tiles whose gate is ``<= tau``
    are never computed and hold exact zeros.

    Args:
        q, k, v: raw projections, ``(batch, heads, *spatial, head_dim)``.
        qh, kh, vh: multi-scale projections, same shape.
        gate: ``(batch, *tiles)`` with ``tiles = ceil(spatial / block)``; ``None`` selects
            every tile (dense evaluation, used by the soft training path).
        tau: threshold; a tile is active when ``gate > tau``.
        block: tile size per axis.
        window: odd local window size per axis.
        add_to: optional tensor of ``q``'s shape (the inference path passes the linear
            attention output): with a ``gate``, ``M * R`` (each active tile weighted by its gate
            value ``M``) is added to it in place and it is returned instead of ``R``, so that
            ``R`` is never materialised at full size.

    Returns:
        ``R``, shape and dtype of ``q``; or ``add_to``.
    """
    check_refine((q, k, v, qh, kh, vh), gate, block, window, add_to)
    if gate is None:
        index = _all_tiles(q.shape, block, q.device)
    else:
        index = torch.nonzero(gate.flatten() > tau).squeeze(1)
    if index.shape[0] == 0:
        return torch.zeros_like(q) if add_to is None else add_to
    if add_to is None:
        return _tiled((q, k, v), (qh, kh, vh), window, block, index, eps).to(q.dtype)
    weight = gate.flatten()[index]
    if _channel_first(add_to).is_contiguous():  # the layer's linear output: written tile by tile
        return _tiled((q, k, v), (qh, kh, vh), window, block, index, eps, weight, add_to)
    return add_to.add_(_tiled((q, k, v), (qh, kh, vh), window, block, index, eps, weight))


def attend(linear, refine_fn, q, k, v, qh, kh, vh, gate, tau, refine: bool, block: int, window: int, eps: float = DEFAULT_EPS):
    """The layer's inference output from a linear attention and a refinement of the signatures
    of :func:`linear_attention` and :func:`local_refine`: ``O_lin`` (``refine`` False, routing
    ``off``), ``O_lin + R`` (``gate`` None, routing ``all``) or ``O_lin + [M > tau] * M * R``
    (routing ``gate``). With this module's two it is the reference of the fused kernels
    (``hsmla_med.kernels.attention``); :meth:`~hsmla_med.nn.dispatch.BackendChoice.attend` composes
    each backend's pair with it."""
    out = linear(qh, kh, vh, eps)
    if not refine:
        return out
    if gate is None:
        return out + refine_fn(q, k, v, qh, kh, vh, None, 0.0, block, window, eps)
    return refine_fn(q, k, v, qh, kh, vh, gate, tau, block, window, eps, add_to=out)


def block_gate(
    ms: torch.Tensor,
    taps: torch.Tensor,
    conv_bias: torch.Tensor,
    weight: torch.Tensor,
    gate_bias: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """Block gate ``M`` ``(batch, *tiles)`` of a map made of whole ``block``-sized tiles, from the
    arguments the C gate takes (the reference of ``hsmla_med.kernels.block_gate_cpu``).

    ``G^h_b = sigmoid(w_h . AvgPool_b(DWConv3x3(ms)) + b_h)``, ``M_b = mean_h G^h_b``, with
    ``AvgPool_b o DWConv3x3`` as one depthwise convolution of stride ``block`` (the layer's
    fused pooling kernel, docs/design.md §2.4).

    Args:
        ms: multi-scale tokens ``(b, 3C, *S)``, every side a multiple of ``block``.
        taps: the fused kernel tap by tap, ``(prod(kernel), 3C)`` with ``kernel = block + 2``
            per axis (row-major taps).
        conv_bias: ``(3C,)``; weight: per-head projections ``(3, heads, d)`` with
            ``3 * heads * d = 3C``; gate_bias: ``(heads,)``.
        block: tile size per axis.

    Returns:
        ``M`` in the dtype of ``ms``.
    """
    spatial = tuple(ms.shape[2:])
    if any(n % block for n in spatial):
        raise ValueError(f"block_gate takes maps of whole {block}-sized tiles, got spatial size {spatial}.")
    channels, heads = ms.shape[1], weight.shape[1]
    kernel = taps.t().reshape(channels, 1, *[block + 2] * len(spatial))
    conv = (F.conv2d, F.conv3d)[len(spatial) - 2]
    pooled = conv(ms, kernel, conv_bias, stride=block, padding=1, groups=channels)  # (b, 3C, *tiles)
    # row (t, h, i) of the (3C, heads) projection holds w_h[t, i] in column h: all heads in one matmul
    eye = weight.new_ones(heads).diag()  # not torch.eye(device=...): a trace would fix its device
    matrix = (weight.unsqueeze(-1) * eye.view(1, heads, 1, heads)).reshape(-1, heads)
    logits = pooled.flatten(2).transpose(1, 2) @ matrix + gate_bias  # (b, tiles, heads)
    return logits.sigmoid().mean(dim=-1).view(ms.shape[0], *pooled.shape[2:])
