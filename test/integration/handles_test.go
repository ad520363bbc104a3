package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// TestFileHandlesPerFileSystem: a share whose own file system gives no
// file handles (an overlayfs without nfs_export, as a container's root)
// with a tmpfs mounted inside. With the default --inode-file-handles=prefer
// the daemon starts, serves both, and logs one line per file system held
// by fds. In a sandbox, the capability is dropped at start (the share's
// file system decided it), so the tmpfs, which gives handles, is held by
// fds too, logged once; without one (the race build, as root) the tmpfs
// keeps handles.
func TestFileHandlesPerFileSystem(t *testing.T) {
	base := t.TempDir()
	for _, d := range []string{"lower", "upper", "work", "share"} {
		if err := os.Mkdir(filepath.Join(base, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	share := filepath.Join(base, "share")
	os.WriteFile(filepath.Join(base, "lower", "f"), []byte("lower"), 0o644)
	os.Mkdir(filepath.Join(base, "lower", "sub"), 0o755)
	mopts := fmt.Sprintf("lowerdir=%s/lower,upperdir=%s/upper,workdir=%s/work,nfs_export=off,index=off", base, base, base)
	if err := unix.Mount("overlay", share, "overlay", 0, mopts); err != nil {
		t.Skipf("cannot mount an overlayfs here: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(share, unix.MNT_DETACH) })
	if err := unix.Mount("tmpfs", filepath.Join(share, "sub"), "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(filepath.Join(share, "sub"), unix.MNT_DETACH) })
	for i := range 3 {
		os.WriteFile(filepath.Join(share, "sub", fmt.Sprint(i)), []byte("tmpfs"), 0o644)
	}

	d := startDaemonWith(t, daemonSpec{share: share})
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	c.mount()
	for range 2 {
		f := c.lookup(vmm.RootID, "f").NodeID
		fh := c.open(f, unix.O_RDONLY)
		if got := string(c.read(f, fh, 0, 16)); got != "lower" {
			t.Fatalf("READ f: %q", got)
		}
		sub := c.lookup(vmm.RootID, "sub").NodeID
		for i := range 3 {
			c.lookup(sub, fmt.Sprint(i))
		}
	}
	c.check()
	lines := d.logCount("no inode file handles on this mount")
	want := 1
	if d.pid() != d.Pid() { // sandboxed: CAP_DAC_READ_SEARCH dropped
		want = 2
		checkThreads(t, d.pid(), keptCaps)
		if n := d.logCount("needs CAP_DAC_READ_SEARCH"); n != 1 {
			t.Errorf("%d lines for the tmpfs held by fds, want 1\n%s", n, d.Tail(30))
		}
	}
	if lines != want {
		t.Errorf("%d lines for file systems held by fds, want %d\n%s", lines, want, d.Tail(30))
	}
	noViolations(t, dev)
}
