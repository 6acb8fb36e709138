"""A tiny tool for multi-turn runs of the CPU recipe (verl ``tool_agent`` loop).

``digits(n)`` returns ``n`` (1..32) pseudo-random digits. The tiny task rewards digits in the
assistant's own text, so the tool only exercises the multi-turn path (tool call parsing, tool
response tokens with ``response_mask = 0``, further assistant turns).
"""

from __future__ import annotations

import random
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class DigitsTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._seeds: dict[str, int] = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        create_kwargs = kwargs.get("create_kwargs", kwargs)
        self._seeds[instance_id] = int(create_kwargs.get("seed", 0)) if isinstance(create_kwargs, dict) else 0
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        try:
            n = int(parameters.get("n", 4))
        except (TypeError, ValueError):
            n = 4
        n = max(1, min(32, n))
        rng = random.Random(self._seeds.get(instance_id, 0) * 1000 + n)
        return ToolResponse(text="".join(rng.choice("0123456789") for _ in range(n))), 0.0, {}

    async def release(self, instance_id: str, **kwargs) -> None:
        self._seeds.pop(instance_id, None)
