"""What every section of params.yaml shares: strict, frozen models that forbid unknown keys, and the field types
and network-name check more than one section uses."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

# Paths come from YAML as strings; accept those (and only those) for Path fields.
PathField = Annotated[Path, Field(strict=False)]


def _switch_word(value: object) -> object:
    # YAML 1.1 readers (PyYAML) take an unquoted off / on as false / true, and `dvc exp run -S key=off` writes
    # it unquoted (YAML 1.2): the word was meant.
    return ("on" if value else "off") if isinstance(value, bool) else value


OnOffAuto = Annotated[Literal["auto", "on", "off"], BeforeValidator(_switch_word)]
AmpMode = Annotated[Literal["auto", "bf16", "off"], BeforeValidator(_switch_word)]


class Section(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


LIBRARY_NETWORK = re.compile(r"^(torchvision|timm)/[A-Za-z0-9_.\-]+$")


def network_name(name: str) -> str:
    from pipeline import architectures  # light: the table, no torch

    if not (architectures.is_known(name) or LIBRARY_NETWORK.match(name)):
        raise ValueError(
            f"unknown network {name!r}: one of {', '.join(architectures.ARCHITECTURES)}, torchvision/<arch>, "
            "timm/<arch>, or path/to/file.py:function"
        )
    return name
