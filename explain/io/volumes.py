"""Volumes: a scan read from a NIfTI file (with ``nibabel``), a folder of one DICOM series (with ``pydicom``; both
optional extras, imported only when such a file is read) or a 3-D ``.npy``; its heatmap written as a NIfTI with the
scan's own shape and affine, which radiologists' viewers overlay on the scan; and a montage of the three slices
through the map's peak as its picture."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ..errors import InputLoadError, first_line
from .atomic import write_atomically
from .render import overlay

NIFTI_SUFFIXES = (".nii", ".nii.gz")
VOLUME_SUFFIXES = (*NIFTI_SUFFIXES, ".npy")


@dataclass(frozen=True)
class Volume:
    """A scan as stored, one value per voxel.

    Attributes:
        data: The voxels (D, H, W) float32, in the file's own axis order (a NIfTI's i, j, k).
        affine: The 4x4 map from voxel indices to world coordinates (the identity for a ``.npy``).
    """

    data: np.ndarray
    affine: np.ndarray


def _pydicom(path: Path):  # the module, imported when a DICOM series is asked for
    try:
        import pydicom
    except ImportError:
        raise InputLoadError(f'{path}: a DICOM series needs pydicom: pip install "explain[volumes]"') from None
    return pydicom


def read_dicom_series(folder: Path) -> Volume:
    """The slices of the one DICOM series in ``folder``, stacked in order along the slice normal: (slices, rows,
    columns), each slice's rescale slope and intercept applied (Hounsfield units for CT), with the affine from
    voxels to RAS millimetres (NIfTI's convention; DICOM's patient coordinates are LPS).

    Raises:
        InputLoadError: No DICOM slice, several series, slices of different orientation or size, or a file that
            cannot be read; the message names the folder or the file.
    """
    pydicom = _pydicom(folder)
    slices = []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        try:
            slices.append(pydicom.dcmread(path))
        except Exception as err:  # not DICOM, truncated: pydicom raises several kinds
            raise InputLoadError(f"{path}: cannot read the DICOM slice: {first_line(err)}") from None
    if not slices:
        raise InputLoadError(f"{folder}: no DICOM slice")
    if len({str(s.get("SeriesInstanceUID", "")) for s in slices}) > 1:
        raise InputLoadError(f"{folder}: several DICOM series; give a folder of one series")
    try:
        orientations = {tuple(round(float(v), 4) for v in s.ImageOrientationPatient) for s in slices}
        if len(orientations) > 1 or len({(int(s.Rows), int(s.Columns)) for s in slices}) > 1:
            raise InputLoadError(f"{folder}: slices of different orientations or sizes; give one series")
        along_rows, along_columns = np.array(slices[0].ImageOrientationPatient, dtype=np.float64).reshape(2, 3)
        normal = np.cross(along_rows, along_columns)
        slices.sort(key=lambda s: float(np.dot(np.array(s.ImagePositionPatient, dtype=np.float64), normal)))
        data = np.stack([
            s.pixel_array.astype(np.float32) * float(s.get("RescaleSlope", 1)) + float(s.get("RescaleIntercept", 0))
            for s in slices
        ])  # fmt: skip
        first = np.array(slices[0].ImagePositionPatient, dtype=np.float64)
        last = np.array(slices[-1].ImagePositionPatient, dtype=np.float64)
        row_spacing, column_spacing = (float(v) for v in slices[0].PixelSpacing)
        thickness = float(slices[0].get("SliceThickness", 1.0) or 1.0)
    except InputLoadError:
        raise
    except Exception as err:  # a tag missing, or no pixels
        raise InputLoadError(f"{folder}: cannot read the DICOM series: {first_line(err)}") from None
    affine = np.eye(4)
    affine[:3, 0] = (last - first) / (len(slices) - 1) if len(slices) > 1 else normal * thickness
    affine[:3, 1] = along_columns * row_spacing  # the next row lies along the columns' direction
    affine[:3, 2] = along_rows * column_spacing  # the next column along the rows'
    affine[:3, 3] = first
    affine[:2] *= -1  # LPS to RAS
    return Volume(data, affine)


def _nibabel(path: Path):
    try:
        import nibabel
    except ImportError:
        raise InputLoadError(f'{path}: a NIfTI file needs nibabel: pip install "explain[volumes]"') from None
    return nibabel


def is_nifti(path: Path) -> bool:
    """Whether the file's name ends as a NIfTI file's does."""
    return path.name.lower().endswith(NIFTI_SUFFIXES)


def read_volume(path: str | Path) -> Volume:
    """One 3-D scan from a NIfTI file (``.nii``, ``.nii.gz``), a folder of one DICOM series (see
    :func:`read_dicom_series`) or a 3-D ``.npy`` array.

    Raises:
        InputLoadError: The file cannot be read, holds no 3-D volume (a 4-D series, a 2-D array), or holds NaN or
            infinite values; the message names the file.
    """
    path = Path(path)
    if path.is_dir():
        return _checked(read_dicom_series(path), path)
    try:
        if is_nifti(path):
            image = _nibabel(path).load(str(path))
            data, affine = np.asarray(image.dataobj), np.asarray(image.affine, dtype=np.float64)
        elif path.suffix.lower() == ".npy":
            data, affine = np.load(path, allow_pickle=False), np.eye(4)
        else:
            raise InputLoadError(f"{path}: not a volume ({', '.join(VOLUME_SUFFIXES)}, or a folder of DICOM slices)")
    except InputLoadError:
        raise
    except Exception as err:  # a truncated or corrupt file: nibabel and numpy raise many kinds
        raise InputLoadError(f"{path}: cannot read the volume: {first_line(err)}") from None
    return _checked(Volume(data, affine), path)


def _checked(volume: Volume, path: Path) -> Volume:
    """The volume with float32 voxels, once they are known to be one 3-D volume of finite real numbers.

    Raises:
        InputLoadError: They are not; the message names the file.
    """
    data = volume.data
    if data.ndim != 3:
        kind = "a series of volumes" if data.ndim == 4 else "no volume"
        raise InputLoadError(f"{path}: {kind}, shape {data.shape}; explain takes one 3-D volume (D, H, W) per file")
    if not np.issubdtype(data.dtype, np.number) or np.iscomplexobj(data):
        raise InputLoadError(f"{path}: voxels of type {data.dtype}, not real numbers")
    voxels = data.astype(np.float32)
    if not np.isfinite(voxels).all():
        raise InputLoadError(f"{path}: the volume holds NaN or infinite values")
    return Volume(voxels, volume.affine)


def write_heatmap(heatmap: Tensor | np.ndarray, volume: Volume, path: Path) -> None:
    """Write a map of the volume's shape as a float32 NIfTI with the volume's affine, atomically.

    Raises:
        ValueError: The map's shape is not the volume's (upsample it to the volume first).
    """
    values = heatmap.detach().cpu().float().numpy() if isinstance(heatmap, Tensor) else np.asarray(heatmap, np.float32)
    if values.shape != volume.data.shape:
        raise ValueError(f"the heatmap is {values.shape}, the volume {volume.data.shape}: upsample it to the volume")
    encoded = _nibabel(path).Nifti1Image(values.astype(np.float32), volume.affine).to_bytes()
    if path.name.lower().endswith(".gz"):
        encoded = gzip.compress(encoded, compresslevel=6)
    write_atomically(path, lambda temp: temp.write_bytes(encoded))


def intensity_window(data: np.ndarray) -> tuple[float, float]:
    """How a scan is shown grey: its values windowed to their 1st-99th percentile."""
    low, high = np.percentile(data, [1, 99])
    return float(low), float(high)


def grey(slice_: np.ndarray, window: tuple[float, float]) -> np.ndarray:
    """A slice as an RGB uint8 image, its values windowed to [low, high] (see :func:`intensity_window`)."""
    low, high = window
    scaled = np.clip((slice_ - low) / max(high - low, 1e-12), 0, 1)
    return np.repeat((scaled * 255 + 0.5).astype(np.uint8)[..., None], 3, axis=-1)


def montage(
    volume: Volume, heatmap: Tensor | np.ndarray, alpha: float = 0.5, colormap: str = "jet", gap: int = 4
) -> Image.Image:
    """The three slices through the map's peak, one across each axis of the volume, the map blended onto each, side
    by side: the picture of a volume's explanation. The scan is shown grey, windowed to its 1st-99th percentile.

    Args:
        volume: The scan.
        heatmap: Its map, (D, H, W) at the volume's size, values in [0, 1].
        alpha: Weight of the heatmap.
        colormap: A matplotlib colormap name.
        gap: Black pixels between the slices.
    """
    values = torch.as_tensor(heatmap).detach().cpu().float().numpy()
    if values.shape != volume.data.shape:
        raise ValueError(f"the heatmap is {values.shape}, the volume {volume.data.shape}: upsample it to the volume")
    peak = np.unravel_index(int(values.argmax()), values.shape)
    window = intensity_window(volume.data)
    pictures = []
    for axis in range(3):
        scan, heat = np.take(volume.data, peak[axis], axis=axis), np.take(values, peak[axis], axis=axis)
        pictures.append(overlay(grey(scan, window), heat, alpha, colormap))
    height = max(p.height for p in pictures)
    sheet = Image.new("RGB", (sum(p.width for p in pictures) + gap * 2, height))
    left = 0
    for p in pictures:
        sheet.paste(p, (left, 0))
        left += p.width + gap
    return sheet
