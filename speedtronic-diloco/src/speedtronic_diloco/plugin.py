"""Hook implementations wiring DumbDiLoCo into the Speedtronic trainer."""
