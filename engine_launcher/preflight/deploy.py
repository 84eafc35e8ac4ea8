"""Reading a vLLM-Omni deploy YAML: its stages' GPU demands, ``base_config`` overlays merged.

Read with PyYAML when it is importable, otherwise with :func:`scan_deploy_yaml`,
a small reader of the one subset preflight needs (top-level ``base_config`` and
the ``stages:`` list's ``stage_id``, ``gpu_memory_utilization``, ``devices``).
Stage ``devices`` are indices into the engine's ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from engine_launcher.preflight.interpreter import find_package_spec

__all__ = ["DeploySpec", "StageSpec", "read_deploy_spec", "scan_deploy_yaml"]

#: How deep ``base_config`` overlays may chain.
_MAX_BASE_DEPTH: Final = 8


@dataclass(frozen=True, slots=True)
class StageSpec:
    """What one deploy stage asks of the GPUs."""

    stage_id: int
    gpu_memory_utilization: float | None = None
    devices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DeploySpec:
    """The parts of a deploy YAML preflight reads (after ``base_config`` merging)."""

    path: Path
    stages: tuple[StageSpec, ...] = ()
    files: tuple[Path, ...] = field(default=())  # the overlay chain, overlay first


def read_deploy_spec(path: Path) -> DeploySpec:
    """Read a deploy YAML and the ``base_config`` files it overlays.

    Stages are merged by ``stage_id``: a key the overlay sets wins; keys it
    leaves out come from the base. A relative ``base_config`` is looked up
    next to the file that names it.

    Raises:
        FileNotFoundError: A ``base_config`` does not exist.
        OSError: A file cannot be read.
        ValueError: A value is not what the format needs, or the chain loops.
    """
    files: list[Path] = []
    layers: list[dict[int, dict[str, Any]]] = []
    current: Path | None = path
    while current is not None:
        if current in files or len(files) >= _MAX_BASE_DEPTH:
            raise ValueError(f"base_config chain too deep or circular at {current.name}")
        files.append(current)
        base, stages = _parse_deploy(current.read_text(encoding="utf-8"))
        layers.append(stages)
        if base is None:
            current = None
        else:
            candidate = Path(base).expanduser()
            current = candidate if candidate.is_absolute() else current.parent / candidate
            if not current.is_file():
                raise FileNotFoundError(f"base_config {base} not found next to {files[-1].name}")
    merged: dict[int, dict[str, Any]] = {}
    for layer in reversed(layers):  # base first, overlay last
        for stage_id, keys in layer.items():
            merged.setdefault(stage_id, {}).update(keys)
    return DeploySpec(
        path=path,
        stages=tuple(_stage(stage_id, merged[stage_id]) for stage_id in sorted(merged)),
        files=tuple(files),
    )


def _stage(stage_id: int, keys: Mapping[str, Any]) -> StageSpec:
    fraction = keys.get("gpu_memory_utilization")
    if fraction is not None:
        try:
            fraction = float(fraction)
        except (TypeError, ValueError):
            raise ValueError(
                f"stage {stage_id}: gpu_memory_utilization {fraction!r} is not a number"
            ) from None
    devices = keys.get("devices")
    parts: tuple[str, ...] = ()
    if devices is not None:
        parts = tuple(d.strip() for d in str(devices).split(",") if d.strip())
    return StageSpec(stage_id=stage_id, gpu_memory_utilization=fraction, devices=parts)


def _parse_deploy(text: str) -> tuple[str | None, dict[int, dict[str, Any]]]:
    loader = _yaml_loader()
    if loader is None:
        return scan_deploy_yaml(text)
    data = loader(text)
    if not isinstance(data, dict):
        raise ValueError("a deploy YAML must be a mapping")  # noqa: TRY004 - callers catch ValueError
    base = data.get("base_config")
    stages: dict[int, dict[str, Any]] = {}
    for item in data.get("stages") or []:
        if isinstance(item, dict) and "stage_id" in item:
            stages[_stage_id(item["stage_id"])] = {
                k: item[k] for k in ("gpu_memory_utilization", "devices") if k in item
            }
    return (None if base is None else str(base)), stages


def _yaml_loader() -> Callable[[str], Any] | None:
    if find_package_spec("yaml") is None:
        return None
    try:
        yaml = importlib.import_module("yaml")
    except ImportError:
        return None
    loader: Callable[[str], Any] = yaml.safe_load
    return loader


def _stage_id(value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"stage_id {value!r} is not an integer") from None


def _strip_comment(line: str) -> str:
    quote = ""
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _scalar(text: str) -> str | None:
    value = text.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value or None


def scan_deploy_yaml(text: str) -> tuple[str | None, dict[int, dict[str, Any]]]:
    """The YAML subset preflight needs, without PyYAML.

    Reads the top-level ``base_config`` and, for each item of the top-level
    ``stages:`` block list, the scalar keys at the item's own level
    (``stage_id``, ``gpu_memory_utilization``, ``devices``, ...). Nested blocks,
    other sections (``platforms:`` has its own ``stages:``) and the contents
    of flow collections are skipped.

    Returns:
        ``(base_config or None, {stage_id: {key: text}})``.

    Raises:
        ValueError: A stage item has no integer ``stage_id``.
    """
    base: str | None = None
    items: list[dict[str, Any]] = []
    in_stages = False
    dash_column: int | None = None
    key_column: int | None = None
    for raw in text.splitlines():
        line = _strip_comment(raw.replace("\t", "    "))
        body = line.strip()
        if not body or body.startswith(("---", "...")):
            continue
        column = len(line) - len(line.lstrip(" "))
        is_item = body == "-" or body.startswith("- ")
        if column == 0 and not (in_stages and is_item):
            key, _, value = body.partition(":")
            in_stages = key.strip() == "stages" and not value.strip()
            dash_column = key_column = None
            if key.strip() == "base_config":
                base = _scalar(value)
            continue
        if not in_stages:
            continue
        if is_item:
            if dash_column is None:
                dash_column = column
            if column != dash_column:
                continue  # an entry of a nested list
            rest = body[1:].lstrip(" ")
            items.append({})
            key_column = column + len(body) - len(rest) if rest else None
            if rest:
                _scan_key(rest, items[-1])
            continue
        if not items or dash_column is None or column <= dash_column:
            continue
        if key_column is None:  # "-" alone: the item's keys start on this line
            key_column = column
        if column == key_column:
            _scan_key(body, items[-1])
    stages: dict[int, dict[str, Any]] = {}
    for item in items:
        if "stage_id" not in item:
            raise ValueError("a stage has no stage_id")
        stages[_stage_id(item.pop("stage_id"))] = item
    return base, stages


def _scan_key(body: str, item: dict[str, Any]) -> None:
    key, sep, value = body.partition(":")
    key = key.strip()
    if sep and key and " " not in key and key[0] not in "'\"[{":
        parsed = _scalar(value)
        if parsed is not None:
            item[key] = parsed
