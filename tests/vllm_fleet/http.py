"""One HTTP call for the router's tests: GET, or POST a JSON body, and the answer whatever its status."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import attrs

TIMEOUT_S = 60.0


@attrs.frozen
class Answer:
    status_code: int
    headers: dict[str, str]
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def fetch(url: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> Answer:
    """GET `url`, or POST `body` as JSON (with `headers`): the answer whatever its status."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            return Answer(answer.status, dict(answer.headers), answer.read().decode())
    except urllib.error.HTTPError as error:
        return Answer(error.code, dict(error.headers), error.read().decode())
