"""A test set of JSON schemas for structured outputs, each with a prompt that asks for it.

:data:`SCHEMAS`: ``(name, prompt, schema)``, ≥ 50 of them: hand-written ones covering the
keywords :func:`runtime.engine.grammar.check_schema` accepts (nested objects, arrays with
minItems/maxItems, enums, anyOf/oneOf, ``$ref``/``$defs`` including recursion, string length,
pattern and format, integer and number bounds, optional fields, tuples, maps) and the schemas
pydantic generates for models (``model_json_schema()``, as LangChain, pydantic-ai and
``client.chat.completions.parse`` send them; the last through the OpenAI SDK's strict
conversion). :data:`UNSUPPORTED`: schemas with a keyword the server refuses, and that keyword.
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from typing import Literal, Optional

from pydantic import BaseModel, Field


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    """``{"type": "object", "properties": props, "required": required (all by default)}``."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            **extra}


S = {"type": "string", "maxLength": 40}
INT = {"type": "integer"}

HAND: list[tuple[str, str, dict]] = [
    ("person", "Describe a fictional person as JSON.",
     obj({"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("capital", "What is the capital of France? Answer in JSON.",
     obj({"city": {"enum": ["Paris", "Lyon", "Marseille", "Nice"]}})),
    ("yes_no", "Is the sky blue? Answer in JSON.", obj({"answer": {"type": "boolean"}})),
    ("address", "Give the address of a made-up company as JSON.",
     obj({"company": S, "address": obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("fruits", "List some fruits as JSON.",
     obj({"fruits": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 4}})),
    ("id_any", "Give an identifier for a library book as JSON.",
     obj({"id": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0}]}})),
    ("order_refs", "Write a small shop order as JSON.",
     {"$defs": {"item": obj({"product": S, "quantity": {"type": "integer", "minimum": 1, "maximum": 10}})},
      **obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3}})}),
    ("optional_fields", "Describe a movie as JSON.",
     obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "rating": {"type": "number"},
          "sequel": {"type": "boolean"}}, ["title"])),
    ("exclusive", "Pick a positive temperature in degrees as JSON.",
     obj({"degrees": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 50}})),
    ("price", "How much does a coffee cost? Answer in JSON.",
     obj({"price": {"type": "number", "minimum": 0, "maximum": 100}, "currency": {"enum": ["USD", "EUR"]}})),
    ("const", "Say hello in JSON.", obj({"kind": {"const": "greeting"}, "text": S})),
    ("nullable", "What is the middle name of a person without one? Answer in JSON.",
     obj({"middle_name": {"type": ["string", "null"], "maxLength": 20}})),
    ("team", "Describe a sports team with its players as JSON.",
     obj({"team": S, "players": {"type": "array", "items": obj({"name": S, "number": {"type": "integer", "minimum": 1,
                                                                                       "maximum": 99}}),
                                 "minItems": 2, "maxItems": 3}})),
    ("airport", "Give an airport code as JSON.", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}})),
    ("birthday", "When is a birthday? Answer in JSON.", obj({"date": {"type": "string", "format": "date"}})),
    ("contact", "Give a contact email address as JSON.",
     obj({"name": S, "email": {"type": "string", "format": "email"}})),
    ("dice", "Roll a die and report it as JSON.", obj({"roll": {"enum": [1, 2, 3, 4, 5, 6]}})),
    ("tree", "Describe a small family tree as JSON.",
     {"$defs": {"node": obj({"name": {"type": "string", "maxLength": 15},
                             "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}})},
      "$ref": "#/$defs/node"}),
    ("shape", "Describe a geometric shape as JSON.",
     {"oneOf": [obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}),
                obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0}})]}),
    ("scores", "Give the scores of three players as JSON.",
     obj({"scores": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 100},
                     "maxProperties": 3}})),
    ("point", "Give a point as JSON.",
     obj({"point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False,
                    "minItems": 2, "maxItems": 2}})),
    ("password", "Suggest a password as JSON.", obj({"password": {"type": "string", "minLength": 8, "maxLength": 16}})),
    ("deep", "Describe a building as JSON.",
     obj({"building": obj({"floor": obj({"room": obj({"number": {"type": "integer", "minimum": 1, "maximum": 999},
                                                       "name": S})})})})),
    ("weekday", "Which days are weekend days? Answer in JSON.",
     obj({"days": {"type": "array", "items": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]},
                   "minItems": 1, "maxItems": 2}})),
    ("even", "Pick an even number as JSON.", obj({"n": {"type": "integer", "multipleOf": 2, "minimum": 0,
                                                         "maximum": 100}})),
    ("wrapped_ref", "Give the size of a box as JSON.",
     {"$defs": {"dim": {"type": "integer", "minimum": 1, "maximum": 100}},
      **obj({"width": {"allOf": [{"$ref": "#/$defs/dim"}], "description": "cm"}, "height": {"$ref": "#/$defs/dim"}})}),
    ("book", "Describe a book as JSON.",
     obj({"title": S, "author": S, "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
          "isbn": {"type": "string", "pattern": "^[0-9]{13}$"}, "genres": {"type": "array", "items": S, "maxItems": 3},
          "in_print": {"type": "boolean"}, "price": {"type": "number", "minimum": 0}, "language": {"enum": ["en", "fr"]}})),
    ("top_array", "List two colours as JSON.",
     {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 2}),
    ("top_enum", "Is this good or bad? Answer in JSON.", {"enum": ["good", "bad", "unknown"]}),
    ("top_string", "Name a planet as JSON.", {"type": "string", "maxLength": 10}),
    ("top_integer", "How many legs does a spider have? Answer in JSON.", {"type": "integer", "minimum": 0,
                                                                            "maximum": 20}),
    ("uuid", "Give a record identifier as JSON.", obj({"id": {"type": "string", "format": "uuid"}})),
    ("timestamp", "When did the meeting start? Answer in JSON.", obj({"at": {"type": "string", "format": "date-time"}})),
    ("tags_map", "Tag a photo as JSON.",
     obj({"tags": {"type": "object", "patternProperties": {"^[a-z]{1,8}$": {"type": "boolean"}}, "maxProperties": 2}})),
    ("matrix", "Give a 2 by 2 matrix as JSON.",
     obj({"rows": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": -9,
                                                                          "maximum": 9},
                                              "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}})),
]


# -- pydantic models, as frameworks generate schemas from them ------------------------------------

class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=20)
    species: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class Owner(BaseModel):
    name: str = Field(max_length=30)
    pets: list[Pet] = Field(min_length=1, max_length=2)


class Car(BaseModel):
    make: str = Field(max_length=20)
    year: int = Field(ge=1950, le=2025)
    color: Color


class Task(BaseModel):
    title: str = Field(max_length=40)
    done: bool
    priority: Optional[int] = Field(default=None, ge=1, le=5)


class TodoList(BaseModel):
    owner: str = Field(max_length=20)
    tasks: list[Task] = Field(max_length=3)


class Point(BaseModel):
    x: float
    y: float


class Segment(BaseModel):
    start: Point
    end: Point


class Weather(BaseModel):
    city: str = Field(max_length=20, description="The city name")
    temperature_c: int = Field(ge=-50, le=60)
    condition: Literal["sunny", "cloudy", "rain", "snow"]


class Event(BaseModel):
    name: str = Field(max_length=30)
    when: dt.date
    attendees: list[str] = Field(default_factory=list, max_length=3)


class Invoice(BaseModel):
    number: str = Field(pattern=r"^INV-[0-9]{4}$")
    amount: float = Field(ge=0)
    paid: bool = False


class Recipe(BaseModel):
    name: str = Field(max_length=30)
    ingredients: list[str] = Field(min_length=2, max_length=4)
    minutes: int = Field(gt=0, le=240)


class Employee(BaseModel):
    name: str = Field(max_length=30)
    manager: Optional["Employee"] = None


class Rating(BaseModel):
    stars: int = Field(ge=1, le=5)
    comment: Optional[str] = Field(default=None, max_length=40)


class Inventory(BaseModel):
    counts: dict[str, int] = Field(max_length=3)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0, le=1)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Animal(BaseModel):
    animal: Cat | Dog = Field(discriminator="kind")


class Coordinates(BaseModel):
    pair: tuple[float, float]


class Session(BaseModel):
    id: uuid.UUID
    user: str = Field(max_length=20)


class Country(BaseModel):
    name: str = Field(max_length=30)
    capital: str = Field(max_length=30)
    population_millions: float = Field(ge=0)


class Quiz(BaseModel):
    question: str = Field(max_length=60)
    options: list[str] = Field(min_length=2, max_length=4)
    answer_index: int = Field(ge=0, le=3)


PYDANTIC: list[tuple[str, str, type[BaseModel]]] = [
    ("pd_owner", "Describe a pet owner and their pets as JSON.", Owner),
    ("pd_car", "Describe a car as JSON.", Car),
    ("pd_todo", "Write a short to-do list as JSON.", TodoList),
    ("pd_segment", "Give a line segment as JSON.", Segment),
    ("pd_weather", "What is the weather in Paris? Answer in JSON.", Weather),
    ("pd_event", "Describe a birthday party as JSON.", Event),
    ("pd_invoice", "Write an invoice as JSON.", Invoice),
    ("pd_recipe", "Give a pancake recipe as JSON.", Recipe),
    ("pd_employee", "Describe an employee and their manager as JSON.", Employee),
    ("pd_rating", "Rate a restaurant as JSON.", Rating),
    ("pd_inventory", "Count the fruit in a basket as JSON.", Inventory),
    ("pd_sentiment", "What is the sentiment of 'I love it'? Answer in JSON.", Sentiment),
    ("pd_animal", "Describe an animal as JSON.", Animal),
    ("pd_coordinates", "Give the coordinates of a place as JSON.", Coordinates),
    ("pd_session", "Describe a login session as JSON.", Session),
    ("pd_country", "Describe Japan as JSON.", Country),
    ("pd_quiz", "Write a quiz question as JSON.", Quiz),
]

#: Models sent the way ``client.chat.completions.parse(response_format=Model)`` sends them.
SDK_STRICT: list[tuple[str, str, type[BaseModel]]] = [
    ("sdk_weather", "What is the weather in Rome? Answer in JSON.", Weather),
    ("sdk_todo", "Write a to-do list for a weekend as JSON.", TodoList),
    ("sdk_quiz", "Write a geography quiz question as JSON.", Quiz),
]


def sdk_strict_schema(model: type[BaseModel]) -> dict:
    """The schema the OpenAI SDK sends for ``response_format=model`` (strict mode)."""
    from openai.lib._pydantic import to_strict_json_schema

    return to_strict_json_schema(model)


SCHEMAS: list[tuple[str, str, dict]] = [
    *HAND,
    *[(name, prompt, model.model_json_schema()) for name, prompt, model in PYDANTIC],
    *[(name, prompt, sdk_strict_schema(model)) for name, prompt, model in SDK_STRICT],
]

#: (schema, the keyword refused, the path ``param`` ends with).
UNSUPPORTED: list[tuple[dict, str, str]] = [
    (obj({"tags": {"type": "array", "items": S, "uniqueItems": True}}), "uniqueItems", "properties.tags.uniqueItems"),
    ({"not": {"type": "integer"}}, "not", "not"),
    (obj({"a": INT}, **{"if": {"required": ["a"]}, "then": {}}), "if", "if"),
    (obj({"a": INT, "b": INT}, ["a"], dependentRequired={"a": ["b"]}), "dependentRequired", "dependentRequired"),
    ({"$defs": {"x": {"type": "string", "format": "ipv5"}}, "$ref": "#/$defs/x"}, "format", "$defs.x.format"),
    ({"allOf": [INT, {"minimum": 3}]}, "allOf", "allOf"),
    ({"$defs": {"x": INT}, "$ref": "#/$defs/x", "maximum": 5}, "maximum", "maximum"),
]
