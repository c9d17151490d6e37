"""Triton Python model: encoded image bytes -> FP32 [3, 224, 224] for efficientnet_lite0.

The same steps as examples/build_efficientnet.py `preprocess`: RGB, centre crop of 87.5% of the short side,
bicubic resize to 224x224, (pixel - 127) / 128, CHW.
"""

import io

import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image

SIZE = 224
CROP_FRACTION = 224 / 256
MEAN, STD = 127.0, 128.0


def preprocess(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as picture:
        picture = picture.convert("RGB")
        width, height = picture.size
        side = min(height, width) * CROP_FRACTION
        top, left = (height - side) / 2, (width - side) / 2
        picture = picture.resize((SIZE, SIZE), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
    pixels = (np.asarray(picture, dtype=np.float32) - MEAN) / STD
    return pixels.transpose(2, 0, 1)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().reshape(-1)
            try:
                pixels = np.stack([preprocess(bytes(image)) for image in images])
            except (OSError, ValueError) as error:  # PIL.UnidentifiedImageError is an OSError
                failure = pb_utils.TritonError(f"cannot decode image: {error}")
                responses.append(pb_utils.InferenceResponse(error=failure))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("PIXELS", pixels)]))
        return responses
