"""ModelConfig -> the JSON that Triton's `/config` returns: every default field, enum names, int64 as numbers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

if TYPE_CHECKING:
    from google._upb._message import Descriptor as UpbDescriptor  # what Message.DESCRIPTOR is with upb
    from google._upb._message import FieldDescriptor as UpbFieldDescriptor

_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def message_to_json_dict(message: Message) -> dict[str, Any]:
    """protobuf's JSON mapping quotes 64-bit integers; Triton prints them as numbers, so unquote them."""
    as_dict = json_format.MessageToDict(
        message, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
    _unquote_int64(as_dict, message.DESCRIPTOR)
    return as_dict


def _unquote_int64(value: dict[str, Any], descriptor: Descriptor | UpbDescriptor) -> None:
    for field in descriptor.fields:
        if field.name not in value:
            continue
        item = value[field.name]
        entry = field.message_type  # None unless the field is TYPE_MESSAGE (or a proto2 group)
        if field.type == FieldDescriptor.TYPE_MESSAGE and entry is not None:
            _unquote_message_field(value, field, item, entry)
        elif field.type in _INT64_TYPES:
            value[field.name] = [int(v) for v in item] if field.is_repeated else int(item)


def _unquote_message_field(
    value: dict[str, Any], field: FieldDescriptor | UpbFieldDescriptor, item: Any, entry: Descriptor | UpbDescriptor
) -> None:
    if entry.GetOptions().map_entry:
        _unquote_map(value, field, item, entry)
    elif field.is_repeated:
        for sub in item:
            _unquote_int64(sub, entry)
    else:
        _unquote_int64(item, entry)


def _unquote_map(
    value: dict[str, Any], field: FieldDescriptor | UpbFieldDescriptor, item: Any, entry: Descriptor | UpbDescriptor
) -> None:
    value_field = entry.fields_by_name["value"]
    value_entry = value_field.message_type
    if value_field.type == FieldDescriptor.TYPE_MESSAGE and value_entry is not None:
        for sub in item.values():
            _unquote_int64(sub, value_entry)
    elif value_field.type in _INT64_TYPES:
        value[field.name] = {k: int(v) for k, v in item.items()}
