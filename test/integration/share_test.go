package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// shareKind is GOVIRTIOFSD_INTEGRATION_SHARE, what every daemon shares:
// "" a directory of the test's temporary directory; "overlay-budget" an
// overlayfs mount (lower, upper and work directories on a tmpfs of their
// own, no nfs_export, so name_to_handle_at answers EOPNOTSUPP and every
// inode is held by fd, as on a container's root) served with
// --inode-fd-budget 16, so that nearly every request evicts or reopens an
// inode (make integration-sandbox runs the escape, CVE and migration
// tests so).
var shareKind = os.Getenv("GOVIRTIOFSD_INTEGRATION_SHARE")

func checkShareKind() error {
	switch shareKind {
	case "", "overlay-budget":
		return nil
	}
	return fmt.Errorf("GOVIRTIOFSD_INTEGRATION_SHARE=%q: want overlay-budget or nothing", shareKind)
}

// shareArgs are the daemon options the share kind calls for.
func shareArgs() []string {
	if shareKind == "overlay-budget" {
		return []string{"--inode-fd-budget", "16"}
	}
	return nil
}

// makeShare makes a fresh share of the kind asked for in tmp and returns
// its path: tmp/share, or with overlay-budget tmp/mnt/share, a directory
// of an overlayfs mounted on tmp/mnt (what the tests put beside the share,
// "outside", is then on the same file system, as in a plain share),
// unmounted when the test ends.
func makeShare(t *testing.T, tmp string) string {
	t.Helper()
	if shareKind != "overlay-budget" {
		dir := filepath.Join(tmp, "share")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	layers, mnt := filepath.Join(tmp, "layers"), filepath.Join(tmp, "mnt")
	for _, p := range []string{layers, mnt} {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := syscall.Mount("tmpfs", layers, "tmpfs", 0, "size=256m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(layers, syscall.MNT_DETACH) })
	for _, l := range []string{"lower", "lower/share", "upper", "work"} {
		if err := os.Mkdir(filepath.Join(layers, l), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A file of the lower layer: its first write is a copy-up.
	if err := os.WriteFile(filepath.Join(layers, "lower", "share", "lower-file"), []byte("lower\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	data := fmt.Sprintf("lowerdir=%s/lower,upperdir=%s/upper,workdir=%s/work", layers, layers, layers)
	if err := syscall.Mount("overlay", mnt, "overlay", 0, data); err != nil {
		t.Fatalf("mount overlay: %v", err)
	}
	// Detached: the daemon may still hold it when the cleanups run.
	t.Cleanup(func() { syscall.Unmount(mnt, syscall.MNT_DETACH) })
	return filepath.Join(mnt, "share")
}
