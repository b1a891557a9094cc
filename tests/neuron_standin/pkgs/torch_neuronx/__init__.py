"""Test bed only: a ``torch_neuronx`` that installs the stand-in ``neuron`` device (tests/neuron_standin) on
import, as TorchNeuron's package registers its PrivateUse1 device. Put ``tests/neuron_standin/pkgs`` on
``PYTHONPATH`` (with the repository root, for ``tests.neuron_standin``)."""

from tests.neuron_standin import install

install()
