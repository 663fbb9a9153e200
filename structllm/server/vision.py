"""A request's images, the front end's side: whether the model takes any (its image
processor, ``multimodal.registry``), how many a prompt may hold, and their bytes
(``media.fetch_all`` under the server's ``MediaPolicy``). Decoding and the prompt's
expansion happen later, in the worker pool (``Preprocessor.chat_prompt``).
"""

from __future__ import annotations

from pathlib import Path

from structllm.multimodal.processor import ImageProcessor
from structllm.server import media
from structllm.server.config import ServerConfig
from structllm.server.errors import APIError


def media_policy(config: ServerConfig) -> media.MediaPolicy:
    local = config.allowed_local_media_path
    return media.MediaPolicy(
        allowed_domains=frozenset(d.lower() for d in config.allowed_media_domains),
        local_path=None if local is None else Path(local),
        max_bytes=config.max_media_bytes,
        timeout=config.media_fetch_timeout,
    )


class Vision:
    """The image side of one front end serving ``model_name`` (``processor`` None: a
    model that takes no images)."""

    def __init__(
        self,
        model_name: str,
        processor: ImageProcessor | None,
        config: ServerConfig,
        policy: media.MediaPolicy | None = None,
    ) -> None:
        self.model_name = model_name
        self.processor = processor
        self.max_images = config.max_images_per_prompt
        self.policy = policy or media_policy(config)

    @property
    def input_modalities(self) -> list[str]:
        """What ``/v1/models`` says the model takes."""
        return ["text", "image"] if self.processor is not None else ["text"]

    def check(self, count: int, param: str) -> None:
        """400 naming ``param`` for images the model or the server's limit refuses."""
        if count == 0:
            return
        if self.processor is None:
            raise APIError(
                400,
                f"the model `{self.model_name}` takes no images (it is served as a text "
                f"model); the request has {count} image part(s)",
                param=param,
                code="image_input_not_supported",
            )
        if count > self.max_images:
            raise APIError(
                400,
                f"the request has {count} images; at most {self.max_images} are allowed per "
                "prompt (--limit-mm-per-prompt)",
                param=param,
            )

    async def load(self, urls: list[str], param: str) -> list[bytes]:
        """The images' bytes, checked and fetched; a 400 naming ``param`` if refused."""
        self.check(len(urls), param)
        if not urls:
            return []
        try:
            return await media.fetch_all(urls, self.policy)
        except media.MediaError as e:
            raise APIError(400, f"cannot read an image: {e}", param=param) from None
