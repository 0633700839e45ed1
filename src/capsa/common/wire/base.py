"""What every answer of the public API (``/v1``, spec/api.openapi.json) shares: frozen once parsed, unknown
fields ignored (so a newer server stays readable by an older client), and fields whose values may grow (a
state, a kind) are plain strings whose known values the schema lists as an enum."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Answer", "known"]


class Answer(BaseModel):
    """A body the API sends: read-only once made; fields the model does not know are dropped."""

    model_config = ConfigDict(frozen=True, extra="ignore")


def known(values: Any) -> Any:
    """A string field whose schema lists the values of the ``Literal`` ``values`` (an open enum): the
    document is the same as for the ``Literal`` itself, but a value added later does not break a client."""
    return Field(json_schema_extra={"enum": list(get_args(values))})
