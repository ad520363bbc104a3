package passthrough

import (
	"os"
	"os/exec"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// TestAllWithFileHandles reruns the whole suite with
// --inode-file-handles=prefer.
func TestAllWithFileHandles(t *testing.T) {
	if os.Getenv("PT_FILE_HANDLES") != "" {
		t.Skip("already in file handle mode")
	}
	if testing.Short() {
		t.Skip("short")
	}
	cmd := exec.Command(os.Args[0], "-test.skip=^TestAllWithFileHandles$", "-test.count=1")
	cmd.Env = append(os.Environ(), "PT_FILE_HANDLES=prefer")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("suite with file handles: %v\n%s", err, out)
	}
}

func TestFileHandleMode(t *testing.T) {
	tf := newTestFS(t, Options{InodeFileHandles: FileHandlesMandatory})
	if !tf.useHandles {
		t.Fatal("file handles not in use")
	}
	os.WriteFile(tf.path("f"), []byte("abc"), 0o644)
	os.Mkdir(tf.path("d"), 0o755)
	before := tf.Stats().InodeFDs
	var nodes []uint64
	for _, n := range []string{"f", "d"} {
		nodes = append(nodes, tf.lookup(rootID, n).NodeId)
	}
	// Inodes pin no fds beyond the shared mount fd.
	if s := tf.Stats(); s.Inodes != 2 || s.InodeFDs > before+1 {
		t.Fatalf("stats %+v (before %d)", s, before)
	}
	fh := tf.open(nodes[0], unix.O_RDONLY)
	if got := tf.read(nodes[0], fh, 0, 3); string(got) != "abc" {
		t.Fatalf("read %q", got)
	}
	tf.release(nodes[0], fh)
	// An object deleted on the host is stale, and its inode number may
	// be reused without confusing the two.
	os.Remove(tf.path("f"))
	var ao gofuse.AttrOut
	if errno := tf.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(nodes[0])}, &ao); errno != syscall.ESTALE {
		t.Fatalf("getattr of a deleted file: %v", errno)
	}
	os.WriteFile(tf.path("f"), []byte("new"), 0o644)
	e := tf.lookup(rootID, "f")
	if e.NodeId == nodes[0] {
		t.Fatal("new file got the stale node")
	}
	tf.getattr(e.NodeId)
	if e := tf.lookup(nodes[1], ".."); e.NodeId != rootID {
		t.Fatalf(".. = %d", e.NodeId)
	}
	for _, n := range append(nodes, e.NodeId) {
		tf.Forget(n, 1)
	}
	if s := tf.Stats(); s.Inodes != 0 || s.InodeFDs != tf.baseFDs {
		t.Fatalf("after forget %+v", s)
	}
}
