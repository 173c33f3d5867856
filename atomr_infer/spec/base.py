"""What every part of the spec is made of: strict models (unknown keys rejected, no coercion
across types, frozen), numbers that are never bools or strings, and cross-field errors that
name their field."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, model_validator

# A number: int or float, never a bool or a string (strict floats accept ints).
Number = Annotated[float, Field(strict=True)]


def int_choice(*allowed: int) -> Any:
    """An int that is one of ``allowed``; never a bool or a string (``Literal[1, 8]`` takes ``true`` as 1)."""

    def check(value: int) -> int:
        if value not in allowed:
            raise ValueError(f"input should be {', '.join(map(str, allowed[:-1]))} or {allowed[-1]}, got {value}")
        return value

    return Annotated[StrictInt, AfterValidator(check)]


class FieldValueError(ValueError):
    """A cross-field check that failed, naming the field (relative to the model) to report it on."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field, self.message = field, message

    def __str__(self) -> str:
        return self.message


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_as_unset(cls, data: Any) -> Any:
        """A section that defaults to empty, written with every key commented out (``serving:``),
        is YAML's null: read as left out, not refused as "not a dictionary"."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default_factory is None}
