"""Triton Python model: encoded image bytes -> PP-OCRv4 detector input and the decoded BGR image."""

import cv2
import numpy as np
import triton_python_backend_utils as pb_utils

MAX_SIDE = 960  # PaddleOCR's det_limit_side_len (limit type "max")
STRIDE = 32  # the detector downsamples by 32: both sides must be multiples of it
MEAN = STD = 0.5  # per channel, as rapidocr_onnxruntime/config.yaml sets for this model


def decode(data: bytes) -> np.ndarray:
    """Encoded image -> H x W x 3 uint8 BGR (the channel order PaddleOCR models are trained on)."""
    image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise ValueError("not an image OpenCV can decode")
    return image


def detector_input(image: np.ndarray) -> np.ndarray:
    height, width = image.shape[:2]
    scale = min(1.0, MAX_SIDE / max(height, width))
    resized_height = max(STRIDE, round(height * scale / STRIDE) * STRIDE)
    resized_width = max(STRIDE, round(width * scale / STRIDE) * STRIDE)
    resized = cv2.resize(image, (resized_width, resized_height))
    pixels = (resized.astype(np.float32) / 255.0 - MEAN) / STD
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)[np.newaxis])


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().reshape(-1)
            try:
                if data.size != 1:
                    raise ValueError(f"expected one image, got {data.size}")
                image = decode(bytes(data[0]))
            except ValueError as error:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))))
                continue
            tensors = [pb_utils.Tensor("DET_INPUT", detector_input(image)), pb_utils.Tensor("IMAGE_BGR", image)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
