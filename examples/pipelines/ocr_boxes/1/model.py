"""Triton Python model: DB post-processing of the PP-OCRv4 detector's map, then text-line crops for the recognizer.

Differentiable Binarization (Liao et al., 2020) at inference: threshold the probability map, take the
connected regions' minimum-area rectangles, keep those whose mean probability is high enough, and grow
each by the "unclip" offset (area * ratio / perimeter) that undoes the shrinking applied to the training
labels. Each box is then warped upright out of the original image and resized to the recognizer's height.
"""

import math

import cv2
import numpy as np
import triton_python_backend_utils as pb_utils

THRESHOLD = 0.3  # probability above which a pixel is text
BOX_THRESHOLD = 0.5  # mean probability a region needs to count as a text box
UNCLIP_RATIO = 1.6
MIN_SIDE = 3  # pixels of the probability map
MAX_CANDIDATES = 1000
REC_HEIGHT = 48
REC_MIN_WIDTH = 320  # PaddleOCR pads every batch to at least the 320 x 48 the recognizer was trained on
REC_MAX_WIDTH = 48 * 40  # very long lines are squeezed rather than making a huge batch
SAME_LINE_PIXELS = 10  # boxes whose tops differ by less are on one line: ordered left to right


def order_corners(points: np.ndarray) -> np.ndarray:
    """Four corners -> top-left, top-right, bottom-right, bottom-left."""
    by_x = points[np.argsort(points[:, 0], kind="stable")]
    left, right = by_x[:2], by_x[2:]
    top_left, bottom_left = left[np.argsort(left[:, 1], kind="stable")]
    top_right, bottom_right = right[np.argsort(right[:, 1], kind="stable")]
    return np.array([top_left, top_right, bottom_right, bottom_left], dtype=np.float32)


def mean_probability(prob: np.ndarray, corners: np.ndarray) -> float:
    """Mean of the map inside the polygon (over its bounding rectangle, masked)."""
    height, width = prob.shape
    x0, y0 = np.clip(np.floor(corners.min(axis=0)).astype(int), 0, [width - 1, height - 1])
    x1, y1 = np.clip(np.ceil(corners.max(axis=0)).astype(int), 0, [width - 1, height - 1])
    mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), dtype=np.uint8)
    cv2.fillPoly(mask, [np.round(corners - [x0, y0]).astype(np.int32)], 1)
    return float(cv2.mean(prob[y0 : y1 + 1, x0 : x1 + 1], mask)[0])


def unclip(rect: tuple) -> tuple:
    """Grow a rotated rectangle by D = area * UNCLIP_RATIO / perimeter on every side.

    Offsetting a rectangle's polygon by D (round joins) and taking the minimum-area rectangle of the
    result, as the reference implementation does with a polygon clipper, gives exactly this rectangle.
    """
    center, (width, height), angle = rect
    distance = width * height * UNCLIP_RATIO / (2 * (width + height))
    return center, (width + 2 * distance, height + 2 * distance), angle


def text_boxes(prob: np.ndarray, image_height: int, image_width: int) -> list[np.ndarray]:
    """[H, W] text probability map -> corner arrays (4 x 2, image pixels) in reading order."""
    bitmap = cv2.dilate((prob > THRESHOLD).astype(np.uint8), np.ones((2, 2), np.uint8))
    contours, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    scale = np.array([image_width / prob.shape[1], image_height / prob.shape[0]], dtype=np.float32)
    boxes = []
    for contour in contours[:MAX_CANDIDATES]:
        rect = cv2.minAreaRect(contour)
        if min(rect[1]) < MIN_SIDE or mean_probability(prob, cv2.boxPoints(rect)) < BOX_THRESHOLD:
            continue
        rect = unclip(rect)
        if min(rect[1]) < MIN_SIDE + 2:
            continue
        corners = order_corners(cv2.boxPoints(rect)) * scale
        corners[:, 0] = np.clip(corners[:, 0], 0, image_width - 1)
        corners[:, 1] = np.clip(corners[:, 1], 0, image_height - 1)
        boxes.append(corners)
    return reading_order(boxes)


def reading_order(boxes: list[np.ndarray]) -> list[np.ndarray]:
    """Top to bottom by the top-left corner; boxes on one line left to right."""
    boxes = sorted(boxes, key=lambda box: (float(box[0, 1]), float(box[0, 0])))
    for end in range(1, len(boxes)):
        for k in range(end, 0, -1):
            upper, lower = boxes[k - 1], boxes[k]
            if abs(lower[0, 1] - upper[0, 1]) < SAME_LINE_PIXELS and lower[0, 0] < upper[0, 0]:
                boxes[k - 1], boxes[k] = lower, upper
            else:
                break
    return boxes


def crop(image: np.ndarray, corners: np.ndarray) -> np.ndarray:
    """The box warped upright; boxes much taller than wide are taken as vertical text and turned."""
    width = max(1, int(max(np.linalg.norm(corners[0] - corners[1]), np.linalg.norm(corners[2] - corners[3]))))
    height = max(1, int(max(np.linalg.norm(corners[0] - corners[3]), np.linalg.norm(corners[1] - corners[2]))))
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    transform = cv2.getPerspectiveTransform(corners.astype(np.float32), target)
    line = cv2.warpPerspective(image, transform, (width, height), flags=cv2.INTER_CUBIC,
                               borderMode=cv2.BORDER_REPLICATE)
    return np.rot90(line) if height / width >= 1.5 else line


def recognizer_input(lines: list[np.ndarray]) -> np.ndarray:
    """Crops -> FP32 [N, 3, 48, W]: each resized to 48 high (aspect kept), scaled to [-1, 1], zero-padded."""
    ratios = [line.shape[1] / line.shape[0] for line in lines]
    width = min(REC_MAX_WIDTH, max(REC_MIN_WIDTH, math.ceil(REC_HEIGHT * max(ratios, default=0))))
    batch = np.zeros((max(1, len(lines)), 3, REC_HEIGHT, width), dtype=np.float32)  # rec needs at least one row
    for row, (line, ratio) in enumerate(zip(lines, ratios, strict=True)):
        resized_width = min(width, max(1, math.ceil(REC_HEIGHT * ratio)))
        resized = cv2.resize(np.ascontiguousarray(line), (resized_width, REC_HEIGHT)).astype(np.float32)
        batch[row, :, :, :resized_width] = (resized / 255.0 - 0.5).transpose(2, 0, 1) / 0.5
    return batch


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            prob = pb_utils.get_input_tensor_by_name(request, "PROB_MAP").as_numpy()[0, 0]
            image = pb_utils.get_input_tensor_by_name(request, "IMAGE_BGR").as_numpy()
            boxes = text_boxes(prob, image.shape[0], image.shape[1])
            crops = recognizer_input([crop(image, box) for box in boxes])
            corners = np.array(boxes, dtype=np.float32).reshape(len(boxes), 4, 2)
            tensors = [pb_utils.Tensor("CROPS", crops), pb_utils.Tensor("BOXES", corners)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
