// Package e2e boots real Linux guests under QEMU (TCG) against the daemon:
// guest.sh builds the guest kernels and initramfs images, the tests in
// e2e_test.go start the daemon and QEMU and check what the guest saw.
// See README.md; run with `make e2e` (root, GOVIRTIOFSD_E2E=1).
package e2e
