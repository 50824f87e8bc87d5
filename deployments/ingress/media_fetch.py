"""A converted request's images made ready for the model: the ingress's limits, and http(s) images fetched.

Conversion (api/images.py) decodes data URLs and base64 blocks; an http(s) image arrives here with empty `data`
and its `url`. `ImageLoader.load` checks the count and each image's size, refuses remote images unless the operator
allows them (`allow_remote_media`), and fetches them concurrently: each within `remote_media_timeout_s` (redirects
included), read as a stream and cut off past `max_image_bytes`, following at most `remote_media_max_redirects`
redirects (http(s) only), and only an image/* answer. Every host connected to, redirects' included, must be a
public address unless `remote_media_allow_private` (media_hosts.py). Every refusal is a 400 naming the image's place.
Pixels are not looked at here: the model side decodes the files (off its event loop) and checks their size.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx

from deployments.ingress_config import MediaLimits
from deployments.ingress.media_hosts import AddressRule, CheckedTransport, HostRefused, Resolver, resolve
from deployments.model_calls import ChatPrompt, ImageInput, TextPrompt
from engine.errors import InvalidRequestError

MIB = 1024 * 1024
_HEADERS = {"User-Agent": "orchard-serve (image fetch)", "Accept": "image/*"}


class ImageLoader:
    """One per ingress: the limits and the HTTP client (made on the first remote image, closed with the app)."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits
        self._client: httpx.AsyncClient | None = None
        self._client_made = asyncio.Lock()

    async def load(self, prompt: ChatPrompt | TextPrompt) -> None:
        """Check the prompt's images against the limits and fill remote ones' `data` and `media_type` in place."""
        images = prompt.images if isinstance(prompt, ChatPrompt) else []
        if not images:
            return
        check_images(images, self.limits)
        remote = [image for image in images if is_unfetched(image)]
        if remote:
            client = await self._http()
            await fetch_images(client, remote, self.limits)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _http(self) -> httpx.AsyncClient:
        async with self._client_made:
            if self._client is None:
                # Building the client loads the CA bundle (tens of ms): not on the event loop.
                self._client = await asyncio.to_thread(new_http_client, self.limits)
            return self._client


def new_http_client(limits: MediaLimits, resolver: Resolver = resolve) -> httpx.AsyncClient:
    """trust_env off: no proxy (it would resolve names past the host check), no .netrc credentials sent to hosts a
    client names."""
    transport = CheckedTransport(AddressRule(limits.remote_media_allow_private), resolver)
    return httpx.AsyncClient(
        transport=transport, trust_env=False, follow_redirects=True, max_redirects=limits.remote_media_max_redirects,
        timeout=limits.remote_media_timeout_s, headers=_HEADERS,
    )


def is_unfetched(image: ImageInput) -> bool:
    return image.url is not None and not image.data


def check_images(images: list[ImageInput], limits: MediaLimits) -> None:
    """The limits that need no fetching: the count, the decoded sizes, remote images allowed at all."""
    if len(images) > limits.max_images_per_request:
        count = f"{len(images)} image{'s' if len(images) != 1 else ''}"
        first_over = images[limits.max_images_per_request].param
        raise InvalidRequestError(
            f"{count}; this server takes at most {limits.max_images_per_request} per request "
            "(max_images_per_request)", param=first_over)
    for image in images:
        if len(image.data) > limits.max_image_bytes:
            raise _too_big(image, limits, len(image.data))
        if is_unfetched(image) and not limits.allow_remote_media:
            raise InvalidRequestError(
                f"{image.param}: this server does not fetch image URLs ({_shown(image.url)}): send the image as a "
                "data URL (data:image/png;base64,...), or have the operator enable fetching with "
                "'allow_remote_media: true' in the ingress config", param=image.param)


async def fetch_images(client: httpx.AsyncClient, images: list[ImageInput], limits: MediaLimits) -> None:
    """Fetch all at once; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(fetch_image(client, image, limits)) for image in images]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def fetch_image(client: httpx.AsyncClient, image: ImageInput, limits: MediaLimits) -> None:
    """Fill `image.data` and `image.media_type` from `image.url`, or raise an InvalidRequestError naming it."""
    try:
        await asyncio.wait_for(_download(client, image, limits), limits.remote_media_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise _fetch_failed(image, f"it did not arrive within {limits.remote_media_timeout_s:g} s "
                                   "(remote_media_timeout_s)") from None
    except httpx.TooManyRedirects:
        raise _fetch_failed(image, f"more than {limits.remote_media_max_redirects} redirects "
                                   "(remote_media_max_redirects)") from None
    except HostRefused as exc:
        raise _fetch_failed(image, str(exc)) from None
    except httpx.UnsupportedProtocol:
        raise _fetch_failed(image, "a redirect led to a URL that is not http(s)") from None
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as exc:
        raise _fetch_failed(image, f"{type(exc).__name__}: {exc}") from None


async def _download(client: httpx.AsyncClient, image: ImageInput, limits: MediaLimits) -> None:
    async with client.stream("GET", image.url) as response:
        if not response.is_success:
            raise _fetch_failed(image, f"the server answered {response.status_code}")
        media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if not media_type.startswith("image/"):
            raise _fetch_failed(image, f"the answer's content type is '{media_type or 'none'}', not an image type")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_image_bytes:
            raise _too_big(image, limits, int(declared))
        data = bytearray()
        async for piece in response.aiter_bytes():
            data += piece
            if len(data) > limits.max_image_bytes:
                raise _too_big(image, limits)
    if not data:
        raise _fetch_failed(image, "the answer was empty")
    image.data, image.media_type = bytes(data), media_type


def _too_big(image: ImageInput, limits: MediaLimits, size: int | None = None) -> InvalidRequestError:
    """`size`: None where a download was cut off at the limit."""
    measured = f"is {_bytes(size)}" if size is not None else f"is over {_bytes(limits.max_image_bytes)}"
    return InvalidRequestError(
        f"{image.param}: the image {measured}; this server takes at most {_bytes(limits.max_image_bytes)} per "
        "image (max_image_bytes)", param=image.param)


def _bytes(count: int) -> str:
    return f"{count / MIB:.1f} MiB" if count >= MIB else f"{count:,} bytes"


def _fetch_failed(image: ImageInput, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{image.param}: the image at {_shown(image.url)} could not be fetched: {why}",
                               param=image.param)


def _shown(url: str | None) -> str:
    """The URL without its query (signed URLs carry credentials there), cut short: for messages and logs."""
    parts = urlsplit(url or "")
    shown = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
    return shown if len(shown) <= 120 else shown[:117] + "..."
