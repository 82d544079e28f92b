"""Send many one-token completions to a controller, some streamed, `concurrency` at a time, and check each answer:
`python load_client.py URL TOKEN COUNT FIRST` (prompts [FIRST % 997, 5, 7], [FIRST + 1 % 997, 5, 7], ...).
Exits non-zero at the first answer that is not a 200 with its one token."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp

CONCURRENCY = 32


async def _send(url: str, token: str, count: int, first: int) -> None:
    numbers = iter(range(first, first + count))
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:

        async def sender() -> None:
            for number in numbers:
                prompt = [number % 997, 5, 7]
                body = {"model": "stub", "prompt": prompt, "max_tokens": 1, "stream": number % 4 == 0}
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    text = await response.text()
                assert response.status == 200, (response.status, text)
                if body["stream"]:
                    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
                    tokens = [token for chunk in chunks for choice in chunk["choices"] for token in choice["token_ids"]]
                else:
                    tokens = json.loads(text)["choices"][0]["token_ids"]
                assert tokens == [sum(prompt) % 1000], (prompt, text)

        await asyncio.gather(*(sender() for _ in range(CONCURRENCY)))


if __name__ == "__main__":
    asyncio.run(_send(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
