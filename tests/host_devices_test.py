"""Tests of tests.host_devices.emulate_host_devices."""

import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

from tests import host_devices


class EmulateHostDevicesTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("unset", None, "--xla_force_host_platform_device_count=8"),
        (
            "other_flags_kept",
            "--xla_cpu_enable_fast_math=false",
            "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8",
        ),
        (
            "existing_count_kept",
            "--xla_force_host_platform_device_count=4",
            "--xla_force_host_platform_device_count=4",
        ),
    )
    def test_sets_the_xla_flag(self, before, after):
        environ = {} if before is None else {"XLA_FLAGS": before}
        with mock.patch.dict(os.environ, environ, clear=False):
            if before is None:
                os.environ.pop("XLA_FLAGS", None)
            host_devices.emulate_host_devices(8)
            self.assertEqual(os.environ["XLA_FLAGS"], after)


if __name__ == "__main__":
    absltest.main()
