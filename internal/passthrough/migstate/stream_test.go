package migstate

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// The Rust virtiofsd's format, checked against streams built here by hand
// from its description (postcard.go, stream.go), not by our encoder.

// leb is an unsigned LEB128 varint: 7 bits per byte, low first, bit 7 on
// every byte but the last.
func leb(v uint64) []byte {
	var b []byte
	for v >= 0x80 {
		b = append(b, byte(v&0x7f)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

// zz is a zigzag i32 as postcard writes it.
func zz(v int32) []byte { return leb(uint64(uint32(v<<1) ^ uint32(v>>31))) }

// str is a postcard String: its length, then its bytes.
func str(s string) []byte { return append(leb(uint64(len(s))), s...) }

func cat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

// everyLocation is a V2 message with every InodeLocation, ids above 2^32
// and at 2^64-1, a handle id 0, a reference file handle, extreme zigzag
// values and a mount path; everyLocationState is what it decodes to.
var everyLocation = cat(
	[]byte{1}, // PassthroughFs::V2
	[]byte{6}, // 6 inodes
	[]byte{1}, //   id 1
	[]byte{3}, //   refcount 3: 2 + the Path child
	[]byte{0}, //   RootNode
	[]byte{0}, //   file_handle: None
	[]byte{2}, //   id 2
	[]byte{2}, //   refcount
	[]byte{1}, //   Path
	[]byte{1}, //     parent 1
	str("d"),  //     filename
	[]byte{1}, //   file_handle: Some
	[]byte{5}, //     mnt_id 5
	[]byte{1}, //     handle_type -1 (zigzag 1)
	[]byte{2}, //     handle: 2 bytes
	[]byte{0xaa, 0xbb},
	[]byte{3},                            //   id 3
	[]byte{1},                            //   refcount
	[]byte{2},                            //   Invalid
	[]byte{0},                            //   None
	[]byte{0x84, 0x80, 0x80, 0x80, 0x10}, // id 2^32+4
	[]byte{1},                            //   refcount
	[]byte{3},                            //   FullPath
	str("d/f"),                           //     filename
	[]byte{0},                            //   None
	[]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}, // id 2^64-1: 10 bytes
	[]byte{1},                            //   refcount
	[]byte{4},                            //   FileHandle
	[]byte{7},                            //     mnt_id 7
	[]byte{0xfe, 0xff, 0xff, 0xff, 0x0f}, // handle_type 2^31-1 (zigzag 2^32-2)
	[]byte{1, 0x42},                      //     handle: 1 byte
	[]byte{0},                            //   None
	[]byte{0x85, 0x80, 0x80, 0x80, 0x10}, // id 2^32+5
	[]byte{0},                            //   refcount 0
	[]byte{3}, str("x"), []byte{0},       //   FullPath "x", None
	[]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}, // next_inode: 2^64-1
	[]byte{3},                            // 3 handles
	[]byte{0},                            //   id 0
	[]byte{0x84, 0x80, 0x80, 0x80, 0x10}, //   inode 2^32+4
	[]byte{0},                            //   OpenInode
	[]byte{4},                            //     flags O_RDWR (2, zigzag 4)
	[]byte{1}, []byte{1}, []byte{0},      //   id 1, inode 1, OpenInode
	[]byte{0x80, 0x80, 0x08},        //     flags O_DIRECTORY (0x10000, zigzag 0x20000)
	[]byte{2}, []byte{2}, []byte{0}, //   id 2, inode 2, OpenInode
	[]byte{0xff, 0xff, 0xff, 0xff, 0x0f}, //     flags -2^31 (zigzag 2^32-1)
	[]byte{3},                            // next_handle
	[]byte{1, 0, 1, 1},                   // writeback, announce_submounts, posix_acl, sup_group_extension
	[]byte{1},                            // 1 mount path
	[]byte{7}, str("."),                  //   mount 7: the share
)

var everyLocationState = &State{
	V2: true,
	Inodes: []Inode{
		{ID: 1, Refcount: 3, Loc: LocRoot},
		{ID: 2, Refcount: 2, Loc: LocPath, Parent: 1, Path: "d",
			Verify: &FileHandle{MountID: 5, Type: -1, Bytes: []byte{0xaa, 0xbb}}},
		{ID: 3, Refcount: 1, Loc: LocInvalid},
		{ID: 1<<32 + 4, Refcount: 1, Loc: LocFullPath, Path: "d/f"},
		{ID: math.MaxUint64, Refcount: 1, Loc: LocFileHandle, Handle: FileHandle{MountID: 7, Type: math.MaxInt32, Bytes: []byte{0x42}}},
		{ID: 1<<32 + 5, Refcount: 0, Loc: LocFullPath, Path: "x"},
	},
	NextInode: math.MaxUint64,
	Handles: []Handle{
		{ID: 0, Inode: 1<<32 + 4, Flags: unix.O_RDWR},
		{ID: 1, Inode: 1, Flags: unix.O_DIRECTORY},
		{ID: 2, Inode: 2, Flags: math.MinInt32},
	},
	NextHandle: 3,
	Opts:       Negotiated{Writeback: true, PosixACL: true, SuppGroups: true},
	MountPaths: []MountPath{{MountID: 7, Path: "."}},
}

// v1Empty is the Rust daemon's state before INIT, as V1.
var v1Empty = []byte{
	0,          // V1
	0,          // no inodes
	2,          // next_inode
	0,          // no handles
	0,          // next_handle
	0, 0, 0, 0, // negotiated_opts
}

func TestRustFormatDecode(t *testing.T) {
	tests := []struct {
		name string
		b    []byte
		want *State // nil: refused, with err
		err  string
	}{
		{name: "V1 empty", b: v1Empty, want: &State{NextInode: 2, Inodes: []Inode{}, Handles: []Handle{}}},
		{name: "V2 every location", b: everyLocation, want: everyLocationState},
		{name: "V1 with a path", b: cat([]byte{0, 2}, []byte{1, 3, 0, 0}, []byte{2, 1, 1, 1}, str("a"), []byte{0},
			[]byte{3, 0, 0}, []byte{0, 0, 0, 0}),
			want: &State{Inodes: []Inode{{ID: 1, Refcount: 3, Loc: LocRoot}, {ID: 2, Refcount: 1, Loc: LocPath, Parent: 1, Path: "a"}},
				NextInode: 3, Handles: []Handle{}}},
		// postcard takes a varint padded with 0x80 bytes within its
		// maximum length.
		{name: "padded varints", b: cat([]byte{0x80, 0x00}, []byte{0x80, 0x80, 0x00}, []byte{0x82, 0x80, 0x00},
			[]byte{0}, []byte{0}, []byte{0, 0, 0, 0}),
			want: &State{NextInode: 2, Inodes: []Inode{}, Handles: []Handle{}}},

		{name: "empty", b: nil, err: "the stream ends here"},
		{name: "version 2", b: []byte{2}, err: "version variant 2"},
		{name: "our old format", b: []byte("GVFSFUSE\x01\x00\x00\x00"), err: "version variant 71"},
		{name: "11-byte varint", b: cat([]byte{0}, bytes.Repeat([]byte{0x80}, 10), []byte{0}), err: "malformed varint"},
		{name: "u64 overflow in the 10th byte", b: cat([]byte{0, 0}, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02}),
			err: "next_inode (after 12 bytes): malformed varint"},
		{name: "6-byte u32 variant", b: []byte{0x80, 0x80, 0x80, 0x80, 0x80, 0x00}, err: "malformed varint"},
		{name: "u32 overflow", b: []byte{0x80, 0x80, 0x80, 0x80, 0x10}, err: "malformed varint"},
		{name: "unknown location", b: []byte{1, 1, 1, 1, 5}, err: "unknown location variant 5"},
		{name: "bad option", b: []byte{1, 1, 1, 1, 0, 2}, err: "option byte 0x2"},
		{name: "bad bool", b: []byte{0, 0, 2, 0, 0, 1, 2}, err: "bool byte 0x2"},
		{name: "unknown handle source", b: []byte{0, 0, 2, 1, 0, 1, 1}, err: "unknown source variant 1"},
		{name: "zigzag beyond i32", b: []byte{0, 0, 2, 1, 0, 1, 0, 0x80, 0x80, 0x80, 0x80, 0x10}, err: "malformed varint"},
		{name: "not UTF-8", b: cat([]byte{1, 1, 2, 1, 3}, str("\xff")), err: "not UTF-8"},
		{name: "path too long", b: cat([]byte{1, 1, 2, 1, 3}, leb(MaxPath+1)), err: "4096 (max 4095)"},
		{name: "handle too long", b: []byte{1, 1, 2, 1, 4, 1, 0, 0x81, 0x01}, err: "129 (max 128)"},
		{name: "inode count", b: cat([]byte{1}, leb(maxInodes+1)), err: "inode count (after 5 bytes): 4194305 (max 4194304)"},
		{name: "mount count", b: cat([]byte{1, 0, 2, 0, 0, 0, 0, 0, 0}, leb(maxMounts+1)), err: "mount path count"},
		{name: "trailing garbage", b: append(slices.Clone(v1Empty), 'x'), err: "not a govirtiofsd trailer"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := Decode(bytes.NewReader(tc.b), MaxSize)
			if tc.want == nil {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("decode: %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(s, tc.want) {
				t.Fatalf("decoded\n %+v\nwant\n %+v", s, tc.want)
			}
			// Every strict prefix is refused.
			for n := range len(tc.b) {
				if _, err := Decode(bytes.NewReader(tc.b[:n]), MaxSize); err == nil {
					t.Fatalf("a %d-byte prefix decoded", n)
				}
			}
		})
	}
}

// Our encoder writes the same bytes, and our trailer exactly as described.
func TestRustFormatEncode(t *testing.T) {
	var b bytes.Buffer
	if err := Encode(&b, everyLocationState); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b.Bytes(), everyLocation) {
		t.Fatalf("encoded\n% x\nwant\n% x", b.Bytes(), everyLocation)
	}
	b.Reset()
	v1 := &State{NextInode: 2}
	if err := Encode(&b, v1); err != nil || !bytes.Equal(b.Bytes(), v1Empty) {
		t.Fatalf("V1: % x, %v", b.Bytes(), err)
	}

	// With our trailer.
	s := *everyLocationState
	s.Inodes = slices.Clone(s.Inodes)
	s.Handles = slices.Clone(s.Handles)
	s.Ours, s.Session = true, []byte("sess")
	for k := range s.Inodes {
		s.Inodes[k].Type = unix.S_IFDIR
	}
	s.Inodes[2].RawPath = "r\xff"
	s.Inodes[3].Type = unix.S_IFREG
	for k := range s.Handles {
		s.Handles[k].Known, s.Handles[k].HostFlags = true, uint32(0x8000+k)
	}
	s.Handles[1].Dir = true
	le32 := func(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }
	trailer := cat([]byte("GVFSTAIL"), le32(1), le32(4), []byte("sess"), le32(6),
		le32(unix.S_IFDIR), []byte{0, 0},
		le32(unix.S_IFDIR), []byte{0, 0},
		le32(unix.S_IFDIR), []byte{2, 0}, []byte("r\xff"),
		le32(unix.S_IFREG), []byte{0, 0},
		le32(unix.S_IFDIR), []byte{0, 0},
		le32(unix.S_IFDIR), []byte{0, 0},
		le32(3), []byte{0}, le32(0x8000), []byte{1}, le32(0x8001), []byte{0}, le32(0x8002))
	want := cat(everyLocation, trailer)
	want = append(want, le32(crc32.Checksum(want, crc32.MakeTable(crc32.Castagnoli)))...)
	b.Reset()
	if err := Encode(&b, &s); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b.Bytes(), want) {
		t.Fatalf("encoded\n% x\nwant\n% x", b.Bytes(), want)
	}
	got, err := Decode(bytes.NewReader(want), MaxSize)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, &s) {
		t.Fatalf("decoded\n %+v\nwant\n %+v", got, &s)
	}

	// What the decoder would refuse is not written.
	for _, bad := range []*State{
		{Inodes: []Inode{{ID: 2, Loc: LocFullPath, Path: "a/../b"}}},
		{Inodes: []Inode{{ID: 2, Loc: LocFullPath, Path: "\xff"}}},
		{Inodes: []Inode{{ID: 2, Loc: LocFileHandle}}},
		{Inodes: []Inode{{ID: 2, Loc: numLocs}}},
		{MountPaths: []MountPath{{1, "."}}},
		{V2: true, MountPaths: []MountPath{{1, "/"}}},
		{Ours: true, Session: make([]byte, maxSessionRecord+1)},
	} {
		if err := Encode(&bytes.Buffer{}, bad); err == nil {
			t.Errorf("encoded %+v", bad)
		}
	}
}
