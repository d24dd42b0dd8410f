"""The demo's synthetic data set: ten classes of noisy shapes and textures, nothing downloaded.

Ten classes of grey-scale shapes and textures (:data:`CLASS_NAMES`) with random position,
size, rotation, contrast and brightness. It is genuinely learnable but not trivial: at 16x16
pixels with noise, a disk and a filled square, or a ring and a frame, take a convolutional
network a few hundred steps to tell apart.
"""

from __future__ import annotations

import numpy as np

#: The ten classes of the synthetic data set, in label order.
CLASS_NAMES: tuple[str, ...] = (
    "disk",
    "ring",
    "square",
    "frame",
    "plus",
    "cross",
    "h-stripes",
    "v-stripes",
    "triangle",
    "checkers",
)


def make_dataset(
    n: int, *, size: int = 16, seed: int = 0, noise: float = 0.2
) -> tuple[np.ndarray, np.ndarray]:
    """Generates ``n`` labelled images of the ten synthetic classes.

    Each image holds one shape or texture of class ``label`` (see :data:`CLASS_NAMES`) at a
    random position, size, rotation (+-17 degrees), stripe frequency and phase, contrast and
    brightness, plus Gaussian pixel noise.

    Args:
      n: number of images.
      size: height and width in pixels.
      seed: seed of the NumPy generator; the same seed gives the same images.
      noise: standard deviation of the pixel noise (the shapes have contrast 0.5 to 1).

    Returns:
      ``(images, labels)``: float32 ``[n, size, size, 1]`` and int32 ``[n]``.

    Example:
      >>> images, labels = make_dataset(8, seed=0)
      >>> images.shape, images.dtype, labels.dtype
      ((8, 16, 16, 1), dtype('float32'), dtype('int32'))
    """
    if n < 1 or size < 4:
        raise ValueError(f"need n >= 1 and size >= 4; got n={n}, size={size}")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(CLASS_NAMES), n)
    grid = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    yy, xx = np.meshgrid(grid, grid, indexing="ij")

    def draw(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, (n, 1, 1)).astype(np.float32)

    cx, cy, radius, angle = draw(-0.35, 0.35), draw(-0.35, 0.35), draw(0.35, 0.6), draw(-0.3, 0.3)
    freq, phase = draw(2.5, 4.0) * np.pi, draw(0.0, 2.0 * np.pi)
    contrast, brightness = draw(0.5, 1.0), draw(-0.3, 0.3)
    width = 0.12  # stroke width of rings, frames, plus and cross
    images = np.zeros((n, size, size), np.float32)
    for label in range(len(CLASS_NAMES)):
        s = np.flatnonzero(labels == label)
        dx, dy = xx - cx[s], yy - cy[s]
        cos, sin = np.cos(angle[s]), np.sin(angle[s])
        u, v = cos * dx + sin * dy, cos * dy - sin * dx
        r, f, p = radius[s], freq[s], phase[s]
        name = CLASS_NAMES[label]
        if name == "disk":
            mask = np.hypot(u, v) < r
        elif name == "ring":
            mask = np.abs(np.hypot(u, v) - r) < width
        elif name == "square":
            mask = np.maximum(np.abs(u), np.abs(v)) < 0.85 * r
        elif name == "frame":
            mask = np.abs(np.maximum(np.abs(u), np.abs(v)) - 0.85 * r) < width
        elif name in ("plus", "cross"):
            if name == "cross":
                u, v = (u + v) / np.sqrt(2.0), (u - v) / np.sqrt(2.0)
            au, av = np.abs(u), np.abs(v)
            mask = ((au < width) & (av < r)) | ((av < width) & (au < r))
        elif name == "h-stripes":
            mask = np.sin(f * v + p) > 0
        elif name == "v-stripes":
            mask = np.sin(f * u + p) > 0
        elif name == "triangle":
            mask = (v < 0.6 * r) & (v > -r) & (np.abs(u) < 0.6 * (v + r))
        else:  # checkers
            mask = np.sin(0.8 * f * u + p) * np.sin(0.8 * f * v + p) > 0
        images[s] = mask
    images = images * contrast + brightness
    images += rng.normal(0.0, noise, images.shape).astype(np.float32)
    return images[..., None], labels.astype(np.int32)
