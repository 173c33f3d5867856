"""What every part of the spec is made of: strict models (unknown keys rejected, no coercion
across types, frozen), numbers that are never bools or strings, and cross-field errors that
name their field."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A number: int or float, never a bool or a string (strict floats accept ints).
Number = Annotated[float, Field(strict=True)]


class FieldValueError(ValueError):
    """A cross-field check that failed, naming the field (relative to the model) to report it on."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field, self.message = field, message

    def __str__(self) -> str:
        return self.message


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
