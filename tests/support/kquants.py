"""A plain quantizer for llama.cpp's K-quant formats (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), for tests: the ``gguf`` package
dequantizes them but cannot make them. Scales come from each block's range (no search for the best scale, as
``llama-quantize`` does), so the blocks are valid and close to the weights, not the ones llama.cpp would write.
Checked against ``gguf.quants.dequantize``."""

from __future__ import annotations

import numpy as np

Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
K_TYPES = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[..., 8] 6-bit scales and mins -> [..., 12] bytes, as llama.cpp's get_scale_min_k4 reads them."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    return out


def _scale_min_blocks(w: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """w [n, supers, 8, 32] -> codes [n, supers, 256] in 0..top, d and dmin [n, supers] (fp16), sc and mn
    [n, supers, 8]."""
    low = np.minimum(w.min(axis=-1), 0.0)
    scale = (w.max(axis=-1) - low) / top
    d = _f16(scale.max(axis=-1) / 63.0)
    dmin = _f16((-low).max(axis=-1) / 63.0)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-low, dminf, out=np.zeros_like(low), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    offset = (dminf * mn)[..., None]
    q = np.divide(w + offset, step, out=np.zeros_like(w), where=step > 0)
    codes = np.clip(np.round(q), 0, top).astype(np.uint8).reshape(*w.shape[:2], QK_K)
    return codes, d, dmin, sc, mn


def quantize_k(weight: np.ndarray, wtype: int) -> np.ndarray:
    """weight [n, k] (k a multiple of 256) -> [n, k / 256 * block bytes] uint8 blocks of ``wtype``."""
    n, k = weight.shape
    w = weight.astype(np.float32).reshape(n, k // QK_K, 8, 32)
    supers = k // QK_K
    if wtype in (Q4_K, Q5_K):
        codes, d, dmin, sc, mn = _scale_min_blocks(w, 15 if wtype == Q4_K else 31)
        u = codes.reshape(n, supers, 4, 2, 32)  # 64-weight chunks: block 2c, then 2c + 1
        qs = ((u[:, :, :, 0] & 0x0F) | ((u[:, :, :, 1] & 0x0F) << 4)).reshape(n, supers, 128).astype(np.uint8)
        parts = [
            d.view(np.uint8).reshape(n, supers, 2),
            dmin.view(np.uint8).reshape(n, supers, 2),
            _pack_scales(sc, mn),
        ]
        if wtype == Q5_K:
            high = u >> 4  # [n, supers, 4, 2, 32]
            qh = np.zeros((n, supers, 32), dtype=np.uint8)
            for c in range(4):
                qh |= (high[:, :, c, 0] << (2 * c)) | (high[:, :, c, 1] << (2 * c + 1))
            parts.append(qh)
        parts.append(qs)
        return np.concatenate(parts, axis=-1).reshape(n, -1)
    if wtype == Q3_K:
        return _quantize_q3_k(w.reshape(n, supers, 16, 16))
    if wtype == Q2_K:
        return _quantize_q2_k(w.reshape(n, supers, 16, 16))
    if wtype != Q6_K:
        raise ValueError(f"not a K-quant type: {wtype}")
    halves = w.reshape(n, supers, 16, 16)
    scale = np.abs(halves).max(axis=-1) / 31.0
    d = _f16(scale.max(axis=-1) / 127.0)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = np.divide(halves, step, out=np.zeros_like(halves), where=step != 0)
    u = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(n, supers, 2, 4, 32)  # [half][quarter][l]
    ql = np.concatenate(
        [
            (u[:, :, :, 0] & 0x0F) | ((u[:, :, :, 2] & 0x0F) << 4),
            (u[:, :, :, 1] & 0x0F) | ((u[:, :, :, 3] & 0x0F) << 4),
        ],
        axis=-1,
    ).reshape(n, supers, 128)
    qh = (u[:, :, :, 0] >> 4) | ((u[:, :, :, 1] >> 4) << 2) | ((u[:, :, :, 2] >> 4) << 4) | ((u[:, :, :, 3] >> 4) << 6)
    parts = [ql, qh.reshape(n, supers, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, supers, 2)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _quantize_q2_k(halves: np.ndarray) -> np.ndarray:
    """[n, supers, 16, 16] -> Q2_K blocks: w = d sc q - dmin mn per 16, q in 0..3, sc and mn 4 bits."""
    n, supers = halves.shape[:2]
    low = np.minimum(halves.min(axis=-1), 0.0)
    scale = (halves.max(axis=-1) - low) / 3.0
    d = _f16(scale.max(axis=-1) / 15.0)
    dmin = _f16((-low).max(axis=-1) / 15.0)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 15).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-low, dminf, out=np.zeros_like(low), where=dminf > 0)), 0, 15).astype(np.uint8)
    step, offset = (df * sc)[..., None], (dminf * mn)[..., None]
    q = np.divide(halves + offset, step, out=np.zeros_like(halves), where=step > 0)
    codes = np.clip(np.round(q), 0, 3).astype(np.uint8).reshape(n, supers, 2, 4, 32)  # weight 128 half + 32 j + l
    qs = np.zeros((n, supers, 2, 32), dtype=np.uint8)
    for j in range(4):
        qs |= codes[:, :, :, j] << (2 * j)
    parts = [
        sc | (mn << 4),
        qs.reshape(n, supers, 64),
        d.view(np.uint8).reshape(n, supers, 2),
        dmin.view(np.uint8).reshape(n, supers, 2),
    ]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _quantize_q3_k(halves: np.ndarray) -> np.ndarray:
    """[n, supers, 16, 16] -> Q3_K blocks: w = d (sc - 32) v, v in -4..3 (2 low bits and a mask bit) per 16."""
    n, supers = halves.shape[:2]
    scale = np.abs(halves).max(axis=-1) / 4.0
    d = _f16(scale.max(axis=-1) / 31.0)
    df = d.astype(np.float32)[..., None]
    s = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -32, 31).astype(np.int32)
    step = (df * s)[..., None]
    v = np.clip(np.round(np.divide(halves, step, out=np.zeros_like(halves), where=step != 0)), -4, 3).astype(np.int32)
    v = v.reshape(n, supers, 2, 4, 32)  # weight 128 half + 32 j + l
    low, high = (v & 3).astype(np.uint8), (v >= 0).astype(np.uint8)
    qs = np.zeros((n, supers, 2, 32), dtype=np.uint8)
    hmask = np.zeros((n, supers, 32), dtype=np.uint8)
    for half in range(2):
        for j in range(4):
            qs[:, :, half] |= low[:, :, half, j] << (2 * j)
            hmask |= high[:, :, half, j] << (4 * half + j)
    sc = (s + 32).astype(np.uint8)  # [n, supers, 16]
    scales = np.zeros((n, supers, 12), dtype=np.uint8)
    scales[..., 0:4] = (sc[..., 0:4] & 0x0F) | ((sc[..., 8:12] & 0x0F) << 4)
    scales[..., 4:8] = (sc[..., 4:8] & 0x0F) | ((sc[..., 12:16] & 0x0F) << 4)
    scales[..., 8:12] = (
        (sc[..., 0:4] >> 4) | ((sc[..., 4:8] >> 4) << 2) | ((sc[..., 8:12] >> 4) << 4) | ((sc[..., 12:16] >> 4) << 6)
    )
    parts = [hmask, qs.reshape(n, supers, 64), scales, d.view(np.uint8).reshape(n, supers, 2)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)
