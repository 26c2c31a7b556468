"""Complex tensors are stored and reported as complex (format 2.0): a module returning complex
tensors under real torch.compile is captured with its complex64 dtype, h5py reads the records back
as complex, and the metrics are those of the real and imaginary parts (docs/report-format.md)."""

import h5py
import numpy as np
import torch
import torch.nn as nn

from dynaprobe import PrecisionChecker


class Spectrum(nn.Module):
    """A linear layer whose output goes through an FFT: complex64 out, complex gradients in."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return torch.fft.fft(self.linear(x))


def test_complex_outputs_are_captured_compared_and_read_back_as_complex(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(Spectrum())
    checker = PrecisionChecker(dump_dir=str(tmp_path))
    checker.wrap(model[0])
    x = torch.randn(4, 16, requires_grad=True)

    def train_step(m):
        loss = m(x).abs().sum()
        loss.backward()
        return loss

    result = checker.compare(train_step, model)

    rows = {(r.check_type, r.tensor_index): r for r in result.rows if r.module == "0"}
    output = rows[("fwd_output", 0)]
    assert output.status == "PASS", result.text()
    assert output.eager_dtype == "complex64" and output.compiled_dtype == "complex64"
    assert output.shape == (4, 16)
    # Metrics over the real and imaginary parts: twice the elements.
    assert output.metrics["elements"] == 2 * 4 * 16
    assert "shape=(4, 16)  dtype=complex64" in result.text()

    with h5py.File(result.dump_file) as f:
        eager = f["tensors/0/fwd_output.eager.0.0"]
        compiled = f["tensors/0/fwd_output.compiled.0.0"]
        assert eager.attrs["dtype"] == b"complex64"
        assert eager.dtype == np.complex64 and compiled.dtype == np.complex64
        with torch.no_grad():
            want = model[0](x).detach().numpy()
        np.testing.assert_allclose(compiled[()], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(eager[()], want, rtol=1e-5, atol=1e-5)
        # The gradient flowing back into the FFT's output is complex too.
        grads = [name for name in f["tensors/0"] if name.startswith("grad_output.")]
        assert grads and all(f["tensors/0"][name].dtype == np.complex64 for name in grads)
    assert rows[("grad_input", 0)].status == "PASS" and rows[("grad_input", 0)].eager_dtype == "float32"
