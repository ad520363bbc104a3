package passthrough

import (
	"os"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// TestFileWait: a file on tmpfs is local (raw syscalls); one on procfs, as
// any file system not known to be local, may wait.
func TestFileWait(t *testing.T) {
	for _, tc := range []struct {
		path string
		want bufvec.Wait
	}{
		{"/dev/shm", bufvec.Bounded},
		{"/proc/self/status", bufvec.MayWait},
	} {
		f, err := os.Open(tc.path)
		if err != nil {
			t.Skip(err)
		}
		if got, ok := fileWait(int(f.Fd())); got != tc.want || !ok {
			t.Errorf("%s: %v, %v, want %v, true", tc.path, got, ok, tc.want)
		}
		f.Close()
	}
	if got, ok := fileWait(-1); got != bufvec.MayWait || ok {
		t.Errorf("bad fd: %v, %v, want MayWait, false", got, ok)
	}
}

// TestFileWaitCached: an inode learns its file system's answer once: a
// file created in a directory takes the directory's, a file opened takes
// it from its first open, and handles carry it.
func TestFileWaitCached(t *testing.T) {
	tf := newTestFS(t, Options{})
	d, err := os.Open(tf.dir)
	if err != nil {
		t.Fatal(err)
	}
	want, ok := fileWait(int(d.Fd()))
	d.Close()
	if !ok {
		t.Fatal("fstatfs of the share failed")
	}
	wantState := waitBounded
	if want == bufvec.MayWait {
		wantState = waitMayWait
	}

	root := tf.node(gofuse.FUSE_ROOT_ID)
	if got := root.wait.Load(); got != waitUnknown {
		t.Fatalf("root before any create: wait %d, want unknown", got)
	}
	c := tf.create(gofuse.FUSE_ROOT_ID, "new", syscall.O_RDWR, 0o644)
	if got := root.wait.Load(); got != wantState {
		t.Errorf("root after a create in it: wait %d, want %d", got, wantState)
	}
	if got := tf.node(c.NodeId).wait.Load(); got != wantState {
		t.Errorf("created file: wait %d, want %d", got, wantState)
	}
	if got := tf.handles.get(c.Fh).wait; got != want {
		t.Errorf("created file's handle: %v, want %v", got, want)
	}
	tf.release(c.NodeId, c.Fh)

	if err := os.WriteFile(tf.path("old"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	e := tf.lookup(gofuse.FUSE_ROOT_ID, "old")
	i := tf.node(e.NodeId)
	if got := i.wait.Load(); got != waitUnknown {
		t.Fatalf("looked-up file: wait %d, want unknown until opened", got)
	}
	fh := tf.open(e.NodeId, syscall.O_RDONLY)
	if got := i.wait.Load(); got != wantState {
		t.Errorf("opened file: wait %d, want %d", got, wantState)
	}
	if got := tf.handles.get(fh).wait; got != want {
		t.Errorf("opened file's handle: %v, want %v", got, want)
	}
	tf.release(e.NodeId, fh)
}
