"""What a split run did, read off its rings, stand-in and patcher: the passes, patches and first-block cache
of a ``diffuse.client.api.Split``, for summaries and tests."""

from __future__ import annotations


class SplitReadout:
    """The read-only side of a ``Split`` (its ``_rings``, ``ring``, ``splitter`` and ``patcher``)."""

    @property
    def rings(self) -> list:
        """One ring per group of nodes (one in all, unless guidance branches run on groups)."""
        return list(self._rings)

    @property
    def node_reports(self) -> list[dict]:
        return self.ring.node_reports if self.ring else []

    @property
    def patch_calls(self) -> dict | None:
        patcher = self.patcher or (self.splitter.patcher if self.splitter else None)
        return patcher.calls if patcher else None

    @property
    def patch_ahead(self) -> dict | None:
        """Cut calls answered by passes sent ahead ("used"), and passes sent ahead in vain ("dropped")."""
        patcher = self.patcher or (self.splitter.patcher if self.splitter else None)
        return patcher.ahead if patcher else None

    @property
    def patches_used(self) -> dict | None:
        """Per stack: patches asked, patches actually used, and why fewer."""
        patcher = self.patcher or (self.splitter.patcher if self.splitter else None)
        return patcher.used if patcher else None

    @property
    def uncut(self) -> dict[str, str]:
        """Stacks whose steps ran uncut although patches > 1, and why."""
        return dict(self.splitter.uncut) if self.splitter else {}

    @property
    def cache(self) -> dict:
        """The first-block cache per stack: calls tagged and calls skipped (empty when it is off)."""
        from diffuse.firstblock.client import counts

        return counts(self.ring.channel_stats) if self.ring is not None else {}

    @property
    def cache_skipped(self) -> int:
        """Calls whose step the first-block cache skipped, all stacks together."""
        return sum(v["skipped"] for v in self.cache.values())

    @property
    def cache_calls(self) -> int:
        """Calls the first-block cache decided on (skipped or computed in full), all stacks together."""
        return sum(v["calls"] for v in self.cache.values())

    def attention_paths(self) -> dict:
        from diffuse.pipefusion.client import attention_paths

        return attention_paths(self.node_reports)
