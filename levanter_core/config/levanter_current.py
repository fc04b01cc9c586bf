"""Levanter's current ``data:`` schema (``marin-community/marin``, ``lib/levanter``), read as ours.

Levanter's data section now names its sources ``components``, each a ``source`` (where the
records are: ``{type: url, train_urls, validation_urls}`` or ``{type: hf, id, ...}``) beside the
``format`` that reads them, its ``cache_dir`` (default ``{data.cache_dir}/{name}``), ``tags`` and
``pack``, mixed by ``train_weights``::

    data:
      tokenizer: gpt2
      cache_dir: cache/
      components:
        web: {source: {type: url, train_urls: [...], validation_urls: [...]}}
        chat: {source: {type: hf, id: org/chats}, format: {type: chat}, cache_dir: caches/chat}
      train_weights: {web: 0.8, chat: 0.2}

This is the mixture our ``configs:`` form writes (each of our sources holds its location, format,
cache directory and tags together), so :func:`translate_components` rewrites one into the other
before validation. The older forms (a source written inline under ``data:``, or ``configs:``)
build the same mixture: a section is read in one form only. An error in a rewritten field names
the field as the file wrote it, and its line.

Levanter's shuffle is now a block shuffle by default (``{io_block_size: 256, window_blocks:
512}``: blocks of sequences permuted within windows of blocks); here the nearest is the era
shuffle over windows of the same number of sequences (``shuffle: io_block_size x
window_blocks``), which a config in this schema gets when it says nothing.
"""

from __future__ import annotations

from typing import Any

from levanter_core.config.loader import Sources
from levanter_core.config.sft import ProgramTranslation, TranslatedSources

BLOCK_SHUFFLE_DEFAULT = {"io_block_size": 256, "window_blocks": 512}
"""Levanter's default ``data.shuffle`` in its current schema."""

_COMPONENT_FIELDS = {"type", "source", "format", "cache_dir", "tags", "pack", "split"}
_PACKED_FORMATS = {"chat", "supervised", "preference_chat"}
"""Formats whose examples are packed whole into rows here (with a target mask), as Levanter
packs them when ``pack`` is left unset."""


def has_components(raw: Any) -> bool:
    """Whether ``raw`` (a config's merged dict) writes its data in Levanter's current form."""
    return isinstance(raw, dict) and isinstance(raw.get("data"), dict) and "components" in raw["data"]


def translate_components(raw: dict, sources: Sources) -> tuple[dict, Sources]:
    """``raw`` with ``data.components`` rewritten as ``data.configs`` (see the module docstring),
    and sources that report a rewritten field where the file wrote it. Raises
    :class:`~levanter_core.errors.ConfigError` naming the component for what has no meaning here."""
    return _Components(raw, sources).run()


class _Components(ProgramTranslation):
    program = "train_lm, current schema"

    def run(self) -> tuple[dict, Sources]:
        data = dict(self.raw["data"])
        components = data.pop("components")
        if not isinstance(components, dict) or not components:
            self.fail(("data", "components"), "expected a mapping of named components (name: {source, format, ...})")
        for older in ("configs", "train_urls", "validation_urls", "id"):
            if older in data:
                self.fail(
                    ("data", older),
                    f"data.components and data.{older} both say where the data is; write the sources in one form "
                    "(components, or the older configs / inline source)",
                )
        data["configs"] = {str(name): self.component(str(name), section) for name, section in components.items()}
        shuffle = data.get("shuffle", BLOCK_SHUFFLE_DEFAULT)
        data["shuffle"] = self.shuffle(shuffle)
        if "shuffle_before_trainval_split" in data:
            data.pop("shuffle_before_trainval_split")
            if data.get("num_validation_sequences") and self.raw["data"]["shuffle_before_trainval_split"] is not False:
                self.fail(
                    ("data", "shuffle_before_trainval_split"),
                    "a random held-out subset is not available yet: num_validation_sequences holds out the last N "
                    "sequences of each source; set shuffle_before_trainval_split: false for that",
                )
        elif data.get("num_validation_sequences"):
            self.fail(
                ("data", "num_validation_sequences"),
                "Levanter's current schema holds out a random subset (shuffle_before_trainval_split defaults to "
                "true), which is not available yet; set data.shuffle_before_trainval_split: false to hold out the "
                "last N sequences of each source",
            )
        written = dict(self.sources.written) if isinstance(self.sources, TranslatedSources) else {}
        written.update(self.written)
        places = TranslatedSources(self.sources.main_file, self.sources.places, written)
        return {**self.raw, "data": data}, places

    def component(self, name: str, section: Any) -> dict:
        at = ("data", "components", name)
        if not isinstance(section, dict):
            self.fail(at, f"expected a component section (source, format, cache_dir, tags), got {section!r}")
        unknown = sorted(set(section) - _COMPONENT_FIELDS)
        if unknown:
            self.fail(
                (*at, unknown[0]),
                f"not a field of a data component (it has {', '.join(sorted(_COMPONENT_FIELDS - {'type'}))})",
            )
        kind = section.get("type", "cached")
        if kind != "cached":
            self.fail(
                (*at, "type"),
                f"component type {kind!r} is not available: only cached components (read from a source into a "
                "cache) are, the default",
            )
        source = section.get("source")
        if source is None:
            self.fail(
                (*at, "source"),
                "a component without a source reads a cache Levanter built; Levanter's caches are not read here: "
                "give the source (type: url with train_urls / validation_urls, or type: hf with id)",
            )
        if not isinstance(source, dict):
            self.fail((*at, "source"), f"expected a source section (type: url or hf, ...), got {source!r}")
        ours: dict[str, Any] = {}
        for key, value in source.items():
            if key in ("format", "cache_dir", "tags") and key in section:
                continue  # the component's own wins, as in Levanter
            ours[key] = value
            self.written[("data", "configs", name, key)] = (*at, "source", key)
        ours.setdefault("type", "url")
        for key in ("format", "cache_dir", "tags"):
            if key in section:
                ours[key] = section[key]
                self.written[("data", "configs", name, key)] = (*at, key)
        self.check_pack(name, section.get("pack"), ours.get("format"))
        self.written.setdefault(("data", "configs", name), at)
        return ours

    def check_pack(self, name: str, pack: Any, fmt: Any) -> None:
        """``pack`` is accepted where it says what happens here anyway: text joined into one
        stream (unset or false), examples of chat-like formats packed whole (unset or true)."""
        kind = fmt.get("type", "text") if isinstance(fmt, dict) else "text"
        if pack is None:
            return
        packed = kind in _PACKED_FORMATS
        if pack is packed:
            return
        what = (
            "packing whole text documents into rows (with segment ids)"
            if not packed
            else f"{kind} examples not packed, or packed at most N to a row"
        )
        self.fail(
            ("data", "components", name, "pack"),
            f"{what} is not available: {kind} data is {'packed whole' if packed else 'joined into one stream'} "
            "here; remove pack",
        )

    def shuffle(self, value: Any) -> Any:
        """Levanter's block shuffle as the era shuffle over as many sequences; booleans as they are."""
        if not isinstance(value, dict):
            return value
        at = ("data", "shuffle")
        unknown = sorted(set(value) - {"io_block_size", "window_blocks", "perm_type"})
        if unknown:
            self.fail((*at, unknown[0]), "not a field of a block shuffle (io_block_size, window_blocks, perm_type)")
        block, window = value.get("io_block_size"), value.get("window_blocks")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (block, window)):
            self.fail(at, f"io_block_size and window_blocks must be positive integers, got {value!r}")
        self.written[at] = at
        return int(block) * int(window)  # type: ignore[arg-type]  # checked just above
