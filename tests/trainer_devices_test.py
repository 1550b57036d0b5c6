"""Validation of `trainers.engines.devices.split_device`'s arguments."""

from absl.testing import absltest
from absl.testing import parameterized

from trainers.engines import devices


class SplitDeviceTest(parameterized.TestCase):
    def test_unknown_device_type_is_rejected(self):
        with self.assertRaisesRegex(
            ValueError, r"Expected 'CPU' or 'GPU'. Received: device_type='TPU'"
        ):
            devices.split_device("TPU", 2)

    @parameterized.parameters(0, -1, True, 2.0, "2")
    def test_non_positive_int_count_is_rejected(self, count):
        with self.assertRaisesRegex(ValueError, r"Expected a positive int. Received: num_devices="):
            devices.split_device("CPU", count)

    def test_already_split_cpu_is_a_no_op(self):
        # conftest.py split the CPU into 4 before TensorFlow started.
        names = devices.split_device("CPU", 2)
        self.assertGreaterEqual(len(names), 2)


if __name__ == "__main__":
    absltest.main()
