"""The public surface is exactly clutor.__all__; everything else is implementation."""
import clutor


def test_public_api_is_pinned():
    assert sorted(clutor.__all__) == sorted([
        "Model", "Tokenizer", "GenerationChunk", "GenerationStats", "IOReport",
        "ClutorError", "ModelFileError", "UnsupportedError", "ClutorIOError", "ExpertReadError", "BudgetError",
        "QueueFullError", "ClosedError",
    ])
    for name in clutor.__all__:
        assert getattr(clutor, name) is not None
    for err in ("ModelFileError", "UnsupportedError", "ClutorIOError", "ExpertReadError", "BudgetError", "QueueFullError",
                "ClosedError"):
        assert issubclass(getattr(clutor, err), clutor.ClutorError)
