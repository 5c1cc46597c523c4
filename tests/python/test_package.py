"""The package around the operators: the torch version check and the other import errors, the public names, type
hints and the documentation help() shows."""
import inspect
import os
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trellis
from trellis import _library

PUBLIC = ["CRF", "log_matmul", "max_matmul", "linear_cross_entropy", "token_logprobs", "linear_logsumexp",
          "vocab_parallel_linear_cross_entropy", "vocab_parallel_token_logprobs", "vocab_parallel_linear_logsumexp"]


def import_trellis(**environment):
    """Run `import trellis` in a fresh interpreter with this environment changed (None removes a variable)."""
    env = dict(os.environ)
    for name, value in environment.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run([sys.executable, "-c", "import trellis"], env=env, capture_output=True, text=True)


def test_another_torch_release_is_refused():
    with pytest.raises(ImportError) as info:
        _library.check_torch_version("2.11.0", found="2.10.1+cu128")
    message = str(info.value)
    assert "built against PyTorch 2.11.0" in message and "PyTorch 2.10.1+cu128" in message
    assert "torch==2.11.0" in message


@pytest.mark.parametrize("found", ["2.11.0", "2.11.0+cpu", "2.11.0+cu130"])
def test_the_same_release_is_accepted_whatever_its_build(found):
    _library.check_torch_version("2.11.0", found=found)


def test_import_refuses_a_build_for_another_torch():
    result = import_trellis(TRELLIS_TORCH_VERSION="2.9.0")
    assert result.returncode != 0
    assert "ImportError: trellis was built against PyTorch 2.9.0 and cannot run with the PyTorch " \
           f"{torch.__version__}" in result.stderr


def test_import_names_a_missing_library():
    result = import_trellis(TRELLIS_OPS_LIBRARY="/nonexistent/libtrellis_ops.so")
    assert result.returncode != 0
    assert "ImportError: trellis: the operator library /nonexistent/libtrellis_ops.so does not exist" in result.stderr


def test_import_of_an_unbuilt_source_tree_says_how_to_build():
    if (Path(trellis.__file__).parent / "_build_info.py").exists():
        pytest.skip("an installed package")
    result = import_trellis(TRELLIS_OPS_LIBRARY=None)
    assert result.returncode != 0
    assert "pip install ." in result.stderr and "TRELLIS_OPS_LIBRARY" in result.stderr


def test_public_names():
    assert sorted(trellis.__all__) == sorted(PUBLIC)
    assert isinstance(trellis.__version__, str)
    assert (Path(trellis.__file__).parent / "py.typed").exists()


@pytest.mark.parametrize("name", PUBLIC)
def test_documented_and_annotated(name):
    obj = getattr(trellis, name)
    assert inspect.getdoc(obj) and "Args:" in inspect.getdoc(obj)
    functions = [obj] if inspect.isfunction(obj) else [
        getattr(obj, m) for m in ("__init__", "forward", "decode", "kbest", "marginals", "log_partition")]
    for function in functions:
        signature = inspect.signature(function)
        assert signature.return_annotation is not inspect.Signature.empty, function
        for parameter in signature.parameters.values():
            if parameter.name != "self":
                assert parameter.annotation is not inspect.Parameter.empty, (function, parameter.name)
        assert inspect.getdoc(function), function


def test_help_reads_like_pytorch_crf():
    text = pydoc.render_doc(trellis.CRF, renderer=pydoc.plaintext)
    for expected in ("Conditional random field.", "num_tags: Number of tags.", "batch_first: Whether the first",
                     "start_transitions", "end_transitions", "transitions", "decode(self, emissions: torch.Tensor, mask:",
                     "Find the most likely tag sequence using Viterbi algorithm.", "forward(self, emissions: torch.Tensor, tags: torch.Tensor, mask:",
                     "Compute the conditional log likelihood", "reduction", "token_mean", "marginals", "kbest"):
        assert expected in text, expected
