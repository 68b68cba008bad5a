"""OpenAI's list shape (``{"object": "list", "data", "first_id", "last_id", "has_more"}``) over
items that carry an ``id``: stored responses' input items, files, batches."""

from __future__ import annotations

from deploy.errors import APIError

__all__ = ["page"]


def page(items: list[dict], limit: int, after: str | None, order: str, max_limit: int) -> dict:
    """``limit`` (1 to ``max_limit``) of ``items`` (oldest first) past the one ``after`` names,
    in ``order`` ("asc" or "desc"); a 400 for a limit out of range or an unknown ``after``."""
    if not 1 <= limit <= max_limit:
        raise APIError(400, f"limit must be in [1, {max_limit}], got {limit}", param="limit")
    items = items[::-1] if order == "desc" else items
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after: no item {after!r} in this list", param="after")
        items = items[ids.index(after) + 1:]
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}
