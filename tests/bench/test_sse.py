"""The SSE parser against the event-stream rules of the WHATWG HTML standard (section 9.2)."""

from tuili.bench.sse import SSEParser


def events(lines: list[str]) -> list[str]:
    parser = SSEParser()
    out = [data for line in lines if (data := parser.feed(line)) is not None]
    tail = parser.close()
    return out + ([tail] if tail is not None else [])


def test_one_event_per_blank_line():
    assert events(['data: {"a": 1}', "", "data: [DONE]", ""]) == ['{"a": 1}', "[DONE]"]


def test_multiline_data_is_joined_with_newlines():
    assert events(["data: first", "data: second", ""]) == ["first\nsecond"]


def test_only_one_leading_space_is_dropped_and_no_space_is_fine():
    assert events(["data:x", "", "data:  two spaces", ""]) == ["x", " two spaces"]


def test_comments_and_other_fields_are_ignored():
    assert events([": keep-alive", "event: message", "id: 7", "retry: 100", "data: payload", ""]) == ["payload"]


def test_blank_lines_without_data_dispatch_nothing():
    assert events(["", "", ": ping", "", "data: x", ""]) == ["x"]


def test_an_event_pending_at_the_end_of_the_body_is_delivered():
    assert events(["data: a", "", "data: [DONE]"]) == ["a", "[DONE]"]


def test_a_field_without_colon_is_a_name_with_empty_value():
    # "data" alone is the data field with an empty value: the event's data is "".
    assert events(["data", ""]) == [""]
