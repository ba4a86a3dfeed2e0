"""Media a request carries, from URL to checked pixels.

A request's image and video parts name their media by URL; before anything reaches a model, each
URL is turned into bytes under the operator's media policy (data: URLs, http(s) URLs of allowed hosts
only) and those bytes into RGB pixels, every step bounded (`FetchLimits`) so that a client cannot make
the server fetch from its network, hold a worker, or decode a decompression bomb. What cannot be used
is a `MediaError` the server answers 400 with.
"""

from flagdeploy.media.fetch import (
    FetchLimits,
    MediaError,
    VideoFrames,
    content_hash,
    decode_image,
    decode_video,
    fetch_bytes,
)

__all__ = ["FetchLimits", "MediaError", "VideoFrames", "content_hash", "decode_image", "decode_video", "fetch_bytes"]
