"""Data sources by `data.source`: one module with a lister each, one line in DATA_SOURCES (docs/extending.md).

A lister takes `data.root` (and `data.download`) and returns a Listing (pipeline/data/listing.py): the labelled
files, the classes, the test split when the source has one, and what it left out. Prepare decodes, checks and
splits what it lists. Light on purpose (no torch import): params validation reads the table.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipeline.data.listing import Listing


class Lister(Protocol):
    def __call__(self, root: Path, download: bool) -> Listing: ...


@dataclass(frozen=True)
class DataSource:
    """Where a source's lister lives, and what `recipe: auto` and the run's names take from it."""

    lister: str
    """`module:function` (a Lister)."""
    recipe: str = "photos"
    """The built-in recipe `recipe: auto` gives its data."""
    root_is_file: bool = False
    """`data.root` names a file (its stem names the run), not a folder."""
    root_env: str = ""
    """An environment variable that, when set, names another copy of this source's data than `data.root` (CI's
    cache, a shared disk); empty: none."""
    name: str = ""
    """The run's name for this source's data when params.yaml's `name` is empty; empty: the data folder's (or the
    CSV's) name."""


DATA_SOURCES: dict[str, DataSource] = {
    "gtsrb": DataSource("pipeline.data.gtsrb:listing", "gtsrb", root_env="GTSRB_ROOT", name="gtsrb"),  # the demo
    "folder": DataSource("pipeline.data.listing:list_folder"),  # ROOT/<class>/<images>
    "csv": DataSource("pipeline.data.listing:list_csv", root_is_file=True),  # path,label[,group][,box][,split]
}
DEFAULT_SOURCE = "gtsrb"  # data.source when params.yaml names none


def lister(source: str) -> Lister:
    return pkgutil.resolve_name(DATA_SOURCES[source].lister)


def recipe_for(source: str) -> str:
    """The recipe `recipe: auto` gives a source's data (an unknown source, refused later by validation: the default
    source's)."""
    return DATA_SOURCES.get(source, DATA_SOURCES[DEFAULT_SOURCE]).recipe
