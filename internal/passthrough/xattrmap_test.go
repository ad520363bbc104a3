package passthrough

import (
	"bytes"
	"os"
	"sort"
	"strings"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

func TestParseXattrMap(t *testing.T) {
	for _, bad := range []string{":foo:all:a:b:", ":prefix:nowhere:a:b:", ":prefix:all:a:", ":map:a:b: :ok:all:::", " "} {
		if m, err := parseXattrMap(bad); err == nil && m != nil {
			t.Errorf("%q accepted", bad)
		}
	}
	m, err := parseXattrMap(" :prefix:client:trusted.:user.virtiofs.:  |bad|server||security.| /ok/all/user./user./ ")
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		guest, host string
		errno       syscall.Errno
	}{
		{"trusted.x", "user.virtiofs.trusted.x", 0},
		{"user.a", "user.a", 0},
		{"security.selinux", "", syscall.EPERM}, // no client rule matches
	}
	for _, c := range cases {
		got, errno := m.toHost([]byte(c.guest))
		if errno != c.errno || string(got) != c.host {
			t.Errorf("toHost(%q) = %q %v", c.guest, got, errno)
		}
	}
	for host, want := range map[string]string{"user.a": "user.a", "security.selinux": "", "trusted.x": ""} {
		got, ok := m.toGuest([]byte(host))
		if string(got) != want || ok != (want != "") {
			t.Errorf("toGuest(%q) = %q %v", host, got, ok)
		}
	}
}

func TestXattrMapOps(t *testing.T) {
	tf := newTestFS(t, Options{Xattr: true, XattrMap: ":map:trusted.:user.virtiofs.:"})
	os.WriteFile(tf.path("f"), nil, 0o644)
	unix.Setxattr(tf.path("f"), "trusted.host", []byte("h"), 0) // hidden: matches key unprefixed
	unix.Setxattr(tf.path("f"), "user.plain", []byte("p"), 0)
	e := tf.lookup(rootID, "f")
	h := hdr(e.NodeId)
	if errno := tf.SetXAttr(&gofuse.SetXAttrIn{InHeader: *h}, []byte("trusted.overlay.opaque"), []byte("y")); errno != 0 {
		t.Fatal(errno)
	}
	var b [64]byte
	if n, _ := unix.Getxattr(tf.path("f"), "user.virtiofs.trusted.overlay.opaque", b[:]); string(b[:n]) != "y" {
		t.Fatalf("host name not prefixed: %q", b[:n])
	}
	if n, errno := tf.GetXAttr(h, []byte("trusted.overlay.opaque"), b[:]); errno != 0 || string(b[:n]) != "y" {
		t.Fatalf("get mapped: %q %v", b[:n], errno)
	}
	// The guest cannot reach the prefixed names directly.
	if _, errno := tf.GetXAttr(h, []byte("user.virtiofs.trusted.overlay.opaque"), b[:]); errno != syscall.ENODATA {
		t.Fatalf("direct get of prefixed name: %v", errno)
	}
	if errno := tf.SetXAttr(&gofuse.SetXAttrIn{InHeader: *h}, []byte("user.virtiofs.x"), nil); errno != syscall.EPERM {
		t.Fatalf("direct set of prefixed name: %v", errno)
	}
	n, errno := tf.ListXAttr(h, nil)
	if errno != 0 {
		t.Fatal(errno)
	}
	buf := make([]byte, n)
	n, errno = tf.ListXAttr(h, buf)
	if errno != 0 {
		t.Fatal(errno)
	}
	names := strings.Split(strings.TrimSuffix(string(buf[:n]), "\x00"), "\x00")
	sort.Strings(names)
	if strings.Join(names, ",") != "trusted.overlay.opaque,user.plain" {
		t.Fatalf("list %q", names)
	}
	if _, errno := tf.ListXAttr(h, make([]byte, 3)); errno != syscall.ERANGE {
		t.Fatalf("small list buffer: %v", errno)
	}
	if errno := tf.RemoveXAttr(h, []byte("trusted.overlay.opaque")); errno != 0 {
		t.Fatal(errno)
	}
	if n, _ := unix.Listxattr(tf.path("f"), b[:]); bytes.Contains(b[:n], []byte("user.virtiofs.")) {
		t.Fatalf("not removed: %q", b[:n])
	}
}

// POSIX ACLs: SETXATTR of system.posix_acl_access with
// FUSE_SETXATTR_ACL_KILL_SGID clears the set-group-ID bit.
func TestACLKillSGID(t *testing.T) {
	tf := newTestFS(t, Options{Xattr: true, PosixACL: true})
	p := tf.path("f")
	os.WriteFile(p, nil, 0o644)
	unix.Chmod(p, 0o2775)
	e := tf.lookup(rootID, "f")
	// version 2; USER_OBJ rwx, GROUP_OBJ r-x, OTHER r-x
	acl := []byte{2, 0, 0, 0,
		1, 0, 7, 0, 0xff, 0xff, 0xff, 0xff,
		4, 0, 5, 0, 0xff, 0xff, 0xff, 0xff,
		0x20, 0, 5, 0, 0xff, 0xff, 0xff, 0xff}
	in := &gofuse.SetXAttrIn{InHeader: *hdr(e.NodeId), Size: uint32(len(acl))}
	if errno := tf.SetXAttr(in, []byte("system.posix_acl_access"), acl); errno != 0 {
		t.Fatal(errno)
	}
	if m := statHost(t, p).Mode & 0o7777; m != 0o2755 {
		t.Fatalf("without the flag: mode %o", m)
	}
	in.SetXAttrFlags = gofuse.SETXATTR_ACL_KILL_SGID
	if errno := tf.SetXAttr(in, []byte("system.posix_acl_access"), acl); errno != 0 {
		t.Fatal(errno)
	}
	if m := statHost(t, p).Mode & 0o7777; m != 0o755 {
		t.Fatalf("with ACL_KILL_SGID: mode %o", m)
	}
}
