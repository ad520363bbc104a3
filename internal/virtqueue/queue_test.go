package virtqueue

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

func TestNew(t *testing.T) {
	g := newGuest(t)
	base := newRing(g, 8).config()
	endOfA := uint64(uvaA + sizeA)
	tests := []struct {
		name string
		mod  func(c *Config)
		ok   bool
	}{
		{"valid", func(c *Config) {}, true},
		{"size 1", func(c *Config) { c.Size = 1 }, true},
		{"size 0", func(c *Config) { c.Size = 0 }, false},
		{"size 3", func(c *Config) { c.Size = 3 }, false},
		{"size 100", func(c *Config) { c.Size = 100 }, false},
		{"size 32767", func(c *Config) { c.Size = 32767 }, false},
		{"size 32769", func(c *Config) { c.Size = 32769 }, false},
		{"size 65535", func(c *Config) { c.Size = 65535 }, false},
		{"size 32768", func(c *Config) {
			c.Size = MaxSize
			c.DescAddr = g.uva(0x100000)  // 512 KiB
			c.AvailAddr = g.uva(0x180000) // 64 KiB + 6
			c.UsedAddr = g.uva(0x200000)  // 256 KiB + 6
		}, true},
		{"desc misaligned by 8", func(c *Config) { c.DescAddr += 8 }, false},
		{"desc misaligned by 1", func(c *Config) { c.DescAddr++ }, false},
		{"avail odd", func(c *Config) { c.AvailAddr++ }, false},
		{"avail 2-aligned", func(c *Config) { c.AvailAddr += 2 }, true},
		{"used 2-aligned", func(c *Config) { c.UsedAddr += 2 }, false},
		{"used 4-aligned", func(c *Config) { c.UsedAddr += 4 }, true},
		{"desc outside memory", func(c *Config) { c.DescAddr = 0x1000 }, false},
		{"desc given as a GPA", func(c *Config) { c.DescAddr = ringDesc }, false},
		{"avail outside memory", func(c *Config) { c.AvailAddr = uvaD + sizeD }, false},
		{"used outside memory", func(c *Config) { c.UsedAddr = math.MaxUint64 - 3 }, false},
		{"desc straddles A|B", func(c *Config) { c.DescAddr = endOfA - 64 }, false},
		{"desc ends at the end of A", func(c *Config) { c.DescAddr = endOfA - 128 }, true},
		{"avail straddles A|B", func(c *Config) { c.AvailAddr = endOfA - 20 }, false},
		{"avail ends at the end of A", func(c *Config) { c.AvailAddr = endOfA - 22 }, true},
		{"used straddles A|B", func(c *Config) { c.UsedAddr = endOfA - 68 }, false},
		{"used near the end of D", func(c *Config) { c.UsedAddr = uvaD + sizeD - 72 }, true}, // 70 bytes
		{"used past the end of D", func(c *Config) { c.UsedAddr = uvaD + sizeD - 68 }, false},
	}
	for _, tc := range tests {
		cfg := base
		tc.mod(&cfg)
		q, err := New(cfg, g.mem)
		if (err == nil) != tc.ok {
			t.Errorf("%s: err %v, want ok %v", tc.name, err, tc.ok)
		}
		if err == nil {
			if q.Size() != cfg.Size || lastAvail(q) != uint16(cfg.Base) || q.Broken() || q.Pending() {
				t.Errorf("%s: size %d last %d broken %v", tc.name, q.Size(), lastAvail(q), q.Broken())
			}
			q.Close()
		}
	}
	if _, err := New(base, nil); err == nil {
		t.Error("New accepted nil memory")
	}
	// Failed News dropped the references they took.
	g.mem.Put()
	if got := g.released.Load(); got != 3 {
		t.Errorf("%d of 3 mappings released after every ring closed", got)
	}
}

func TestNewReadsUsedIdx(t *testing.T) {
	g := newGuest(t)
	r := newRing(g, 8)
	r.availIdx = 65534 // SET_VRING_BASE: resume here
	r.setUsedIdx(65533)
	q := r.open(t)
	if lastAvail(q) != 65534 {
		t.Fatalf("LastAvail %d", lastAvail(q))
	}
	r.setDesc(0, desc{addr: dataGPA, len: 16})
	r.setDesc(1, desc{addr: dataGPA, len: 16, flags: descWrite})
	c := NewDescChain(8)
	for i, h := range []uint16{0, 1, 0, 1} { // wraps the avail and used indexes
		r.publish(h)
		if ok, err := q.Pop(c, g.mem); !ok || err != nil || c.ID() != h {
			t.Fatalf("pop %d: %v %v head %d", i, ok, err, c.ID())
		}
		q.Push(c.Token, uint32(i))
		if want := uint16(65533 + i + 1); r.usedIdx() != want {
			t.Fatalf("used idx %d, want %d", r.usedIdx(), want)
		}
		if id, n := r.usedElem(uint16(65533 + i)); id != uint32(h) || n != uint32(i) {
			t.Fatalf("used elem %d = {%d %d}", i, id, n)
		}
	}
	if lastAvail(q) != 2 {
		t.Fatalf("LastAvail %d after wrapping", lastAvail(q))
	}
}

// seg is an expected segment.
type seg struct {
	gpa uint64
	n   uint32
}

func segsOf(v *bufvec.Vec) []seg {
	var s []seg
	for _, x := range v.Segments() {
		s = append(s, seg{x.GPA, x.Len})
	}
	return s
}

// checkChain verifies c's segments against want and that each aliases the
// guest memory it names.
func checkChain(t *testing.T, g *guest, c *DescChain, wantR, wantW []seg) {
	t.Helper()
	for _, side := range []struct {
		name string
		v    *bufvec.Vec
		want []seg
	}{{"readable", c.Readable, wantR}, {"writable", c.Writable, wantW}} {
		got := segsOf(side.v)
		if fmt.Sprint(got) != fmt.Sprint(side.want) {
			t.Errorf("%s segments %x, want %x", side.name, got, side.want)
			continue
		}
		for _, s := range side.v.Segments() {
			if !s.Mapped() || !sameBytes(s.Buf, g.host(s.GPA, int(s.Len))) {
				t.Errorf("%s segment %#x+%#x does not alias guest memory", side.name, s.GPA, s.Len)
			}
		}
	}
}

func TestPopPush(t *testing.T) {
	type tc struct {
		name     string
		size     uint16
		indirect bool
		// build lays the chain out and returns the head and the expected
		// segments.
		build func(r *ring) (head uint16, rd, wr []seg)
	}
	tests := []tc{
		{"one readable", 8, false, func(r *ring) (uint16, []seg, []seg) {
			r.setDesc(3, desc{addr: dataGPA, len: 100})
			return 3, []seg{{dataGPA, 100}}, nil
		}},
		{"one writable", 8, false, func(r *ring) (uint16, []seg, []seg) {
			r.setDesc(0, desc{addr: dataGPA, len: 100, flags: descWrite})
			return 0, nil, []seg{{dataGPA, 100}}
		}},
		{"direct readable+writable", 8, false, func(r *ring) (uint16, []seg, []seg) {
			r.setDesc(5, desc{dataGPA, 40, descNext, 2})
			r.setDesc(2, desc{dataGPA + 0x1000, 8, descNext, 7})
			r.setDesc(7, desc{dataGPA + 0x2000, 16, descNext | descWrite, 0})
			r.setDesc(0, desc{dataGPA + 0x3000, 4096, descWrite, 0})
			return 5, []seg{{dataGPA, 40}, {dataGPA + 0x1000, 8}}, []seg{{dataGPA + 0x2000, 16}, {dataGPA + 0x3000, 4096}}
		}},
		{"zero-length descriptors carry nothing", 8, false, func(r *ring) (uint16, []seg, []seg) {
			r.setDesc(0, desc{dataGPA, 0, descNext, 1})
			r.setDesc(1, desc{dataGPA, 10, descNext, 2})
			r.setDesc(2, desc{0, 0, descNext | descWrite, 3})
			r.setDesc(3, desc{dataGPA + 0x100, 10, descWrite, 0})
			return 0, []seg{{dataGPA, 10}}, []seg{{dataGPA + 0x100, 10}}
		}},
		{"chain of exactly Q descriptors", 4, false, func(r *ring) (uint16, []seg, []seg) {
			var rd []seg
			for i := uint16(0); i < 4; i++ {
				r.setDesc(i, desc{dataGPA + uint64(i)*0x100, 10, descNext, (i + 1) % 4})
				rd = append(rd, seg{dataGPA + uint64(i)*0x100, 10})
			}
			r.setDesc(3, desc{dataGPA + 0x300, 10, 0, 0})
			return 0, rd, nil
		}},
		{"buffers in every region", 8, false, func(r *ring) (uint16, []seg, []seg) {
			r.setDesc(0, desc{gpaA, 8, descNext, 1})
			r.setDesc(1, desc{endD - 8, 8, descNext, 2})
			r.setDesc(2, desc{gpaB + 0x100, 8, descNext | descWrite, 3})
			r.setDesc(3, desc{endC - 8, 8, descWrite, 0})
			return 0, []seg{{gpaA, 8}, {endD - 8, 8}}, []seg{{gpaB + 0x100, 8}, {endC - 8, 8}}
		}},
		{"buffer straddling adjacent A|B splits in two", 8, false, func(r *ring) (uint16, []seg, []seg) {
			r.setDesc(0, desc{gpaB - 24, 64, descNext, 1})
			r.setDesc(1, desc{gpaB - 3, 3 + 0x10000, descWrite, 0}) // to the end of B
			return 0, []seg{{gpaB - 24, 24}, {gpaB, 40}}, []seg{{gpaB - 3, 3}, {gpaB, 0x10000}}
		}},
		{"a whole region", 8, false, func(r *ring) (uint16, []seg, []seg) {
			r.setDesc(0, desc{gpaA, sizeA + sizeB, descWrite, 0})
			return 0, nil, []seg{{gpaA, sizeA}, {gpaB, sizeB}}
		}},
		{"indirect", 8, true, func(r *ring) (uint16, []seg, []seg) {
			r.g.writeTable(tablesGPA,
				desc{dataGPA, 40, descNext, 1},
				desc{dataGPA + 0x1000, 4096, descNext, 2},
				desc{dataGPA + 0x3000, 16, descWrite, 0})
			r.setDesc(6, desc{tablesGPA, 48, descIndirect, 0})
			return 6, []seg{{dataGPA, 40}, {dataGPA + 0x1000, 4096}}, []seg{{dataGPA + 0x3000, 16}}
		}},
		{"indirect out of order, WRITE on the indirect descriptor ignored", 8, true, func(r *ring) (uint16, []seg, []seg) {
			// The chain starts at entry 0 and jumps around.
			r.g.writeTable(tablesGPA,
				desc{dataGPA, 40, descNext, 2},
				desc{dataGPA + 0x3000, 16, descWrite, 0},
				desc{dataGPA + 0x1000, 8, descNext | descWrite, 1})
			r.setDesc(1, desc{tablesGPA, 48, descIndirect | descWrite, 0})
			return 1, []seg{{dataGPA, 40}}, []seg{{dataGPA + 0x1000, 8}, {dataGPA + 0x3000, 16}}
		}},
		{"indirect of exactly Q entries", 4, true, func(r *ring) (uint16, []seg, []seg) {
			var ds []desc
			var rd []seg
			for i := uint16(0); i < 4; i++ {
				ds = append(ds, desc{dataGPA + uint64(i)*0x10, 4, descNext, i + 1})
				rd = append(rd, seg{dataGPA + uint64(i)*0x10, 4})
			}
			ds[3].flags = 0
			r.g.writeTable(tablesGPA, ds...)
			r.setDesc(0, desc{tablesGPA, 64, descIndirect, 0})
			return 0, rd, nil
		}},
		{"direct then indirect", 8, true, func(r *ring) (uint16, []seg, []seg) {
			r.g.writeTable(tablesGPA, desc{dataGPA + 0x100, 16, descWrite, 0})
			r.setDesc(2, desc{dataGPA, 40, descNext, 3})
			r.setDesc(3, desc{tablesGPA, 16, descIndirect, 0})
			return 2, []seg{{dataGPA, 40}}, []seg{{dataGPA + 0x100, 16}}
		}},
		{"indirect table straddling adjacent A|B", 8, true, func(r *ring) (uint16, []seg, []seg) {
			table := uint64(gpaB - 32) // two entries in A, two in B
			r.g.writeTable(table,
				desc{dataGPA, 40, descNext, 1},
				desc{dataGPA + 0x200, 8, descNext, 2},
				desc{endD - 16, 16, descNext, 3},
				desc{dataGPA + 0x100, 32, descWrite, 0})
			r.setDesc(4, desc{table, 64, descIndirect, 0})
			return 4, []seg{{dataGPA, 40}, {dataGPA + 0x200, 8}, {endD - 16, 16}}, []seg{{dataGPA + 0x100, 32}}
		}},
		{"indirect table in D, last bytes", 8, true, func(r *ring) (uint16, []seg, []seg) {
			r.g.writeTable(endD-32, desc{dataGPA, 1, descNext, 1}, desc{dataGPA + 1, 1, descWrite, 0})
			r.setDesc(0, desc{endD - 32, 32, descIndirect, 0})
			return 0, []seg{{dataGPA, 1}}, []seg{{dataGPA + 1, 1}}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g := newGuest(t)
			r := newRing(g, tc.size)
			r.indirect = tc.indirect
			q := r.open(t)
			head, wantR, wantW := tc.build(r)
			c := NewDescChain(tc.size)

			// Fill the readable buffers with a pattern the chain must read.
			var pattern []byte
			for i, s := range wantR {
				p := bytes.Repeat([]byte{byte(i + 1)}, int(s.n))
				g.write(s.gpa, p)
				pattern = append(pattern, p...)
			}
			if ok, err := q.Pop(c, g.mem); ok || err != nil {
				t.Fatalf("empty ring: %v %v", ok, err)
			}
			r.publish(head)
			if !q.Pending() {
				t.Fatal("not Pending after publish")
			}
			ok, err := q.Pop(c, g.mem)
			if !ok || err != nil {
				t.Fatalf("Pop: %v %v", ok, err)
			}
			if c.ID() != head || c.Memory() != g.mem {
				t.Fatalf("head %d, want %d", c.ID(), head)
			}
			checkChain(t, g, c, wantR, wantW)
			got := make([]byte, c.Readable.Size())
			if err := c.Readable.ReadFull(got); err != nil || !bytes.Equal(got, pattern) {
				t.Fatalf("readable bytes %x (%v), want %x", got, err, pattern)
			}
			reply := bytes.Repeat([]byte{0xC3}, c.Writable.Size())
			if err := c.Writable.WriteFull(reply); err != nil {
				t.Fatal(err)
			}
			for _, s := range wantW {
				if !bytes.Equal(g.read(s.gpa, int(s.n)), bytes.Repeat([]byte{0xC3}, int(s.n))) {
					t.Fatalf("reply not in guest memory at %#x", s.gpa)
				}
			}
			q.Push(c.Token, uint32(len(reply)))
			if r.usedIdx() != 1 {
				t.Fatalf("used idx %d", r.usedIdx())
			}
			if id, n := r.usedElem(0); id != uint32(head) || n != uint32(len(reply)) {
				t.Fatalf("used elem {%d %d}, want {%d %d}", id, n, head, len(reply))
			}
			if ok, err := q.Pop(c, g.mem); ok || err != nil || q.Pending() {
				t.Fatalf("ring not empty after one chain: %v %v", ok, err)
			}
			c.Release()
			if c.Memory() != nil || c.Readable.Size() != 0 || c.Writable.Size() != 0 {
				t.Fatal("Release kept segments")
			}
		})
	}
}

// TestMalformed feeds each malformed chain class, then a valid chain, and
// checks the error, the head reported, and that the ring keeps serving.
func TestMalformed(t *testing.T) {
	const Q = 8
	const valid = Q - 1 // descriptor index of the valid chain that follows
	type (
		descs  = map[uint16]desc   // ring descriptors by index
		tables = map[uint64][]desc // indirect tables by guest address
	)
	type tc struct {
		name     string
		indirect bool
		head     uint16
		ring     descs
		tables   tables
		want     error
		why      string // in the error message
	}
	const tbl = tablesGPA
	one := []desc{{dataGPA, 8, 0, 0}} // a table of one readable buffer
	loop := descs{}                   // a cycle through every descriptor but the valid one
	for i := uint16(0); i < valid; i++ {
		loop[i] = desc{dataGPA, 8, descNext, (i + 1) % valid}
	}
	var pastQ []desc // a table of Q+1 entries
	for i := uint16(0); i <= Q; i++ {
		pastQ = append(pastQ, desc{dataGPA, 1, descNext, i + 1})
	}
	pastQ[Q].flags = 0
	tests := []tc{
		{name: "head == Q", head: Q, want: ErrBadHead, why: "head 8,"},
		{name: "head 0xffff", head: 0xffff, want: ErrBadHead, why: "head 65535,"},
		{name: "next == Q", ring: descs{0: {dataGPA, 8, descNext, Q}},
			want: ErrBadChain, why: "index 8 beyond"},
		{name: "next 0xffff", head: 2, ring: descs{2: {dataGPA, 8, descNext, 0xffff}},
			want: ErrBadChain, why: "index 65535 beyond"},
		{name: "self loop", head: 1, ring: descs{1: {dataGPA, 8, descNext, 1}},
			want: ErrBadChain, why: "longer than"},
		{name: "two-descriptor loop", ring: descs{0: {dataGPA, 8, descNext, 1}, 1: {dataGPA, 8, descNext, 0}},
			want: ErrBadChain, why: "longer than"},
		{name: "chain longer than Q", head: 3, ring: loop,
			want: ErrBadChain, why: "longer than"},
		{name: "loop of zero-length descriptors", ring: descs{0: {0, 0, descNext, 1}, 1: {0, 0, descNext, 0}},
			want: ErrBadChain, why: "longer than"},
		{name: "indirect without INDIRECT_DESC", ring: descs{0: {tbl, 16, descIndirect, 0}}, tables: tables{tbl: one},
			want: ErrBadChain, why: "without INDIRECT_DESC"},
		{name: "nested indirect", indirect: true, ring: descs{0: {tbl, 32, descIndirect, 0}},
			tables: tables{tbl: {{dataGPA, 8, descNext, 1}, {tbl + 0x100, 16, descIndirect, 0}}, tbl + 0x100: one},
			want:   ErrBadChain, why: "inside an indirect table"},
		{name: "INDIRECT with NEXT", indirect: true, ring: descs{0: {tbl, 16, descIndirect | descNext, 1}, 1: {dataGPA, 8, 0, 0}},
			tables: tables{tbl: one}, want: ErrBadChain, why: "with NEXT"},
		{name: "indirect length 0", indirect: true, ring: descs{0: {tbl, 0, descIndirect, 0}},
			want: ErrBadChain, why: "length 0"},
		{name: "indirect length 24", indirect: true, ring: descs{0: {tbl, 24, descIndirect, 0}}, tables: tables{tbl: one},
			want: ErrBadChain, why: "length 24"},
		{name: "indirect length 8", indirect: true, ring: descs{0: {tbl, 8, descIndirect, 0}},
			want: ErrBadChain, why: "length 8"},
		{name: "indirect with Q+1 entries", indirect: true, ring: descs{0: {tbl, 16 * (Q + 1), descIndirect, 0}},
			tables: tables{tbl: pastQ}, want: ErrBadChain, why: "9 entries exceeds"},
		{name: "indirect length 0xfffffff0", indirect: true, ring: descs{0: {tbl, 0xfffffff0, descIndirect, 0}},
			want: ErrBadChain, why: "exceeds ring size"},
		{name: "misaligned indirect table", indirect: true, ring: descs{0: {tbl + 8, 16, descIndirect, 0}},
			tables: tables{tbl + 8: one}, want: ErrBadChain, why: "misaligned"},
		{name: "indirect table outside memory", indirect: true, ring: descs{0: {0x600000, 32, descIndirect, 0}},
			want: ErrBadChain, why: "indirect table 0x600000+0x20 outside"},
		{name: "indirect table running off the end of C", indirect: true, ring: descs{0: {endC - 16, 32, descIndirect, 0}},
			tables: tables{endC - 16: one}, want: ErrBadChain, why: "indirect table 0x500000+0x10 outside"},
		{name: "indirect table at the top of the address space", indirect: true, ring: descs{0: {math.MaxUint64 - 15, 32, descIndirect, 0}},
			want: ErrBadChain, why: "outside guest memory"},
		{name: "indirect next beyond the table", indirect: true, ring: descs{0: {tbl, 32, descIndirect, 0}},
			tables: tables{tbl: {{dataGPA, 8, descNext, 2}, {dataGPA, 8, 0, 0}, {dataGPA, 8, 0, 0}}},
			want:   ErrBadChain, why: "index 2 beyond table of 2"},
		{name: "loop inside an indirect table", indirect: true, ring: descs{0: {tbl, 32, descIndirect, 0}},
			tables: tables{tbl: {{dataGPA, 8, descNext, 1}, {dataGPA, 8, descNext, 0}}},
			want:   ErrBadChain, why: "longer than its table of 2"},
		{name: "readable after writable", ring: descs{0: {dataGPA, 8, descWrite | descNext, 1}, 1: {dataGPA + 8, 8, 0, 0}},
			want: ErrBadChain, why: "readable descriptor after"},
		{name: "readable after a zero-length writable", ring: descs{0: {dataGPA, 0, descWrite | descNext, 1}, 1: {dataGPA + 8, 8, 0, 0}},
			want: ErrBadChain, why: "readable descriptor after"},
		{name: "readable after writable in an indirect table", indirect: true, ring: descs{0: {tbl, 32, descIndirect, 0}},
			tables: tables{tbl: {{dataGPA, 8, descWrite | descNext, 1}, {dataGPA, 8, 0, 0}}},
			want:   ErrBadChain, why: "readable descriptor after"},
		{name: "readable in an indirect table after a direct writable", indirect: true,
			ring:   descs{0: {dataGPA, 8, descWrite | descNext, 1}, 1: {tbl, 16, descIndirect, 0}},
			tables: tables{tbl: one}, want: ErrBadChain, why: "readable descriptor after"},
		{name: "address in the gap between regions", ring: descs{0: {0x20000, 8, 0, 0}},
			want: ErrBadChain, why: "0x20000+0x8 outside"},
		{name: "address one past the last region", ring: descs{0: {endD, 1, 0, 0}},
			want: ErrBadChain, why: "0x100001000+0x1 outside"},
		{name: "buffer running off the end of B into the gap", ring: descs{0: {gpaB + sizeB - 8, 9, descWrite, 0}},
			want: ErrBadChain, why: "0x20000+0x1 outside"},
		{name: "second buffer outside memory", ring: descs{0: {dataGPA, 8, descNext, 1}, 1: {0x600000, 8, descWrite, 0}},
			want: ErrBadChain, why: "0x600000+0x8 outside"},
		{name: "addr+len overflows", ring: descs{0: {math.MaxUint64 - 15, 32, 0, 0}},
			want: ErrBadChain, why: "wraps"},
		{name: "addr+len wraps to exactly 0", ring: descs{0: {math.MaxUint64 - 15, 16, 0, 0}},
			want: ErrBadChain, why: "wraps"},
		{name: "addr+len overflow in an indirect table", indirect: true, ring: descs{0: {tbl, 16, descIndirect, 0}},
			tables: tables{tbl: {{math.MaxUint64, 2, descWrite, 0}}}, want: ErrBadChain, why: "wraps"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g := newGuest(t)
			r := newRing(g, Q)
			r.indirect = tc.indirect
			q := r.open(t)
			c := NewDescChain(Q)
			for gpa, table := range tc.tables {
				g.writeTable(gpa, table...)
			}
			for i, d := range tc.ring {
				r.setDesc(i, d)
			}
			head := tc.head
			r.setDesc(valid, desc{dataGPA + 0x8000, 40, 0, 0})
			r.publish(head, valid)

			ok, err := q.Pop(c, g.mem)
			if !ok || !errors.Is(err, tc.want) {
				t.Fatalf("Pop: %v %v, want %v", ok, err, tc.want)
			}
			if c.ID() != head {
				t.Fatalf("error reported head %d, want %d", c.ID(), head)
			}
			if !strings.Contains(err.Error(), tc.why) {
				t.Fatalf("error %q does not say %q", err, tc.why)
			}
			if tc.want == ErrBadChain {
				q.Push(c.Token, 0)
			}
			if q.Broken() {
				t.Fatal("ring broken by a malformed chain")
			}
			ok, err = q.Pop(c, g.mem)
			if !ok || err != nil || c.ID() != valid {
				t.Fatalf("valid chain after the bad one: %v %v head %d", ok, err, c.ID())
			}
			// Nothing of the bad chain leaks into the next one.
			checkChain(t, g, c, []seg{{dataGPA + 0x8000, 40}}, nil)
			q.Push(c.Token, 0)
			wantUsed := uint16(1)
			if tc.want == ErrBadChain {
				wantUsed = 2
				if id, n := r.usedElem(0); id != uint32(head) || n != 0 {
					t.Fatalf("bad chain returned as {%d %d}", id, n)
				}
			}
			if r.usedIdx() != wantUsed {
				t.Fatalf("used idx %d, want %d", r.usedIdx(), wantUsed)
			}
			if lastAvail(q) != 2 || q.Pending() {
				t.Fatalf("LastAvail %d", lastAvail(q))
			}
		})
	}
}

func TestTooManySegments(t *testing.T) {
	// 100 adjacent 4 KiB regions: one buffer across 80 of them needs more
	// segments than a chain of a ring of 8 may hold (8 + regionSplits).
	var layout []regionSpec
	for i := range uint64(100) {
		layout = append(layout, regionSpec{gpa: 0x100000 + i*0x1000, size: 0x1000, uva: 0x7000_0000_0000 + i*0x2000, off: i * 0x1000})
	}
	layout = append(layout, regionSpec{gpa: 0x1000, size: 0x10000, uva: 0x1000, mapping: 1})
	g := newGuestLayout(t, layout, []int{100 * 0x1000, 0x10000})
	r := &ring{g: g, size: 8, desc: 0x1000, avail: 0x2000, used: 0x3000}
	q := r.open(t)
	c := NewDescChain(8)
	r.setDesc(0, desc{0x100000, 80 * 0x1000, 0, 0})
	r.setDesc(1, desc{0x100800, 60 * 0x1000, descWrite, 0}) // 61 segments: fits
	r.publish(0, 1)
	if ok, err := q.Pop(c, g.mem); !ok || !errors.Is(err, ErrBadChain) {
		t.Fatalf("80 segments: %v %v", ok, err)
	}
	if ok, err := q.Pop(c, g.mem); !ok || err != nil || len(c.Writable.Segments()) != 61 {
		t.Fatalf("61 segments: %v %v %d", ok, err, len(c.Writable.Segments()))
	}
}

func TestAvailIdxJump(t *testing.T) {
	for _, jump := range []uint16{9, 100, 0x8000, 0xffff} {
		g := newGuest(t)
		r := newRing(g, 8)
		r.eventIdx = true
		q := r.open(t)
		c := NewDescChain(8)
		r.setDesc(0, desc{dataGPA, 8, 0, 0})
		r.publish(0)
		if ok, err := q.Pop(c, g.mem); !ok || err != nil {
			t.Fatal(ok, err)
		}
		r.setAvailIdx(1 + jump)
		ok, err := q.Pop(c, g.mem)
		if ok || !errors.Is(err, ErrBroken) || !q.Broken() {
			t.Fatalf("jump %d: %v %v broken %v", jump, ok, err, q.Broken())
		}
		r.setAvailIdx(2) // too late: the ring stays broken
		if ok, err := q.Pop(c, g.mem); ok || !errors.Is(err, ErrBroken) {
			t.Fatalf("after break: %v %v", ok, err)
		}
		if q.Pending() || q.EnableNotify() {
			t.Fatal("broken ring reports pending chains")
		}
		if lastAvail(q) != 1 {
			t.Fatalf("LastAvail %d after break", lastAvail(q))
		}
	}
	// A jump of exactly Q is legal: every slot is pending.
	g := newGuest(t)
	r := newRing(g, 8)
	q := r.open(t)
	c := NewDescChain(8)
	for i := range uint16(8) {
		r.setDesc(i, desc{dataGPA, 8, 0, 0})
	}
	r.publish(0, 1, 2, 3, 4, 5, 6, 7)
	for i := range uint16(8) {
		if ok, err := q.Pop(c, g.mem); !ok || err != nil || c.ID() != i {
			t.Fatalf("pop %d: %v %v", i, ok, err)
		}
	}
}

func TestPopNilMemory(t *testing.T) {
	g := newGuest(t)
	r := newRing(g, 8)
	q := r.open(t)
	c := NewDescChain(8)
	r.setDesc(0, desc{dataGPA, 8, 0, 0})
	r.publish(0)
	if ok, err := q.Pop(c, nil); ok || err == nil || errors.Is(err, ErrBroken) {
		t.Fatalf("Pop without memory: %v %v", ok, err)
	}
	if ok, err := q.Pop(c, g.mem); !ok || err != nil {
		t.Fatalf("the chain was lost: %v %v", ok, err)
	}
}

// eventfd returns a non-blocking eventfd and a function that reads (and
// resets) its counter.
func eventfd(t *testing.T) (int, func() uint64) {
	t.Helper()
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd, func() uint64 {
		var b [8]byte
		n, err := unix.Read(fd, b[:])
		if errors.Is(err, unix.EAGAIN) {
			return 0
		}
		if err != nil || n != 8 {
			t.Fatalf("read eventfd: %d %v", n, err)
		}
		return uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24
	}
}

// signals installs a call eventfd on q and returns a function that reads
// (and resets) the count of signals on it.
func signals(t *testing.T, q *Queue) func() uint64 {
	t.Helper()
	fd, count := eventfd(t)
	q.SetCall(fd)
	return count
}

func TestEventIdx(t *testing.T) {
	g := newGuest(t)
	r := newRing(g, 8)
	r.eventIdx = true
	q := r.open(t)
	fd, count := eventfd(t)
	if old := q.SetCall(fd); old != -1 {
		t.Fatalf("SetCall returned %d", old)
	}
	c := NewDescChain(8)
	for i := range uint16(8) {
		r.setDesc(i, desc{dataGPA, 8, 0, 0})
	}
	pop := func() {
		t.Helper()
		if ok, err := q.Pop(c, g.mem); !ok || err != nil {
			t.Fatalf("Pop: %v %v", ok, err)
		}
		if r.availEvent() != lastAvail(q) {
			t.Fatalf("avail_event %d after Pop, want %d", r.availEvent(), lastAvail(q))
		}
	}

	// Nothing pushed: no signal whatever used_event says.
	if err := q.Notify(); err != nil || count() != 0 {
		t.Fatal("signalled with nothing pushed")
	}

	// The guest waits for used idx to pass 0.
	r.setUsedEvent(0)
	r.publish(0)
	pop()
	q.Push(0, 0)
	if err := q.Notify(); err != nil || count() != 1 {
		t.Fatal("not signalled when used idx passed used_event")
	}
	// Nothing new since: no second signal.
	if q.Notify(); count() != 0 {
		t.Fatal("signalled twice for one push")
	}

	steps := []struct {
		name      string
		usedEvent uint16
		pushes    int
		want      uint64
	}{
		// used idx is 1 here; the comments show old -> new used idx.
		{"used_event behind (stale)", 0, 1, 0},             // 1 -> 2
		{"used_event = old idx", 2, 1, 1},                  // 2 -> 3
		{"used_event ahead", 10, 1, 0},                     // 3 -> 4
		{"batch crossing used_event", 5, 3, 1},             // 4 -> 7
		{"batch ending just past used_event", 9, 3, 1},     // 7 -> 10
		{"batch ending one past used_event", 11, 2, 1},     // 10 -> 12
		{"suppressed by a far used_event", 0x8000, 4, 0},   // 12 -> 16
		{"batch ending right before used_event", 19, 3, 0}, // 16 -> 19
		{"used_event reached by the next push", 19, 1, 1},  // 19 -> 20
		{"used_event wraps ahead", 0xffff, 2, 0},           // 20 -> 22
	}
	for _, s := range steps {
		r.setUsedEvent(s.usedEvent)
		for range s.pushes {
			r.publish(0)
			pop()
			q.Push(0, 0)
		}
		if err := q.Notify(); err != nil {
			t.Fatal(err)
		}
		if got := count(); got != s.want {
			t.Errorf("%s (used idx now %d): %d signals, want %d", s.name, r.usedIdx(), got, s.want)
		}
	}

	// PushNotify decides in one step.
	r.setUsedEvent(r.usedIdx())
	r.publish(0)
	pop()
	if err := q.PushNotify(0, 0); err != nil || count() != 1 {
		t.Fatal("PushNotify did not signal")
	}

	// EnableNotify writes avail_event and reports pending chains.
	r.setAvailEvent(0xdead)
	if q.EnableNotify() {
		t.Fatal("EnableNotify reports chains on an empty ring")
	}
	if r.availEvent() != lastAvail(q) {
		t.Fatalf("avail_event %#x after EnableNotify, want %d", r.availEvent(), lastAvail(q))
	}
	r.publish(0)
	r.setAvailEvent(0xdead)
	if !q.EnableNotify() {
		t.Fatal("EnableNotify missed a published chain")
	}
	if r.availEvent() != lastAvail(q) {
		t.Fatal("avail_event not written")
	}
	if r.usedFlags() != 0 {
		t.Fatalf("used flags %#x", r.usedFlags())
	}

	// Without a call fd nothing is signalled, and the decision is consumed.
	q.SetCall(-1)
	pop()
	r.setUsedEvent(r.usedIdx())
	q.Push(0, 0)
	if err := q.Notify(); err != nil {
		t.Fatal(err)
	}
	q.SetCall(fd)
	if q.Notify(); count() != 0 {
		t.Fatal("signalled for entries already decided on")
	}
}

// TestEventIdxFirstNotify: a fresh ring knows nothing of what the guest was
// told before (a restarted ring, a reconnected daemon), so its first
// notification decision signals even when used_event is stale.
func TestEventIdxFirstNotify(t *testing.T) {
	g := newGuest(t)
	r := newRing(g, 8)
	r.eventIdx = true
	r.setUsedIdx(5)   // a previous device pushed up to 5...
	r.setUsedEvent(3) // ...but the guest has seen only 3
	r.availIdx = 5
	q := r.open(t)
	count := signals(t, q)
	c := NewDescChain(8)
	r.setDesc(0, desc{dataGPA, 8, 0, 0})
	r.publish(0)
	if ok, err := q.Pop(c, g.mem); !ok || err != nil {
		t.Fatal(ok, err)
	}
	q.Push(0, 0)
	if q.Notify(); count() != 1 {
		t.Fatal("first notification after a ring start was suppressed")
	}
	r.publish(0)
	q.Pop(c, g.mem)
	q.Push(0, 0)
	if q.Notify(); count() != 0 {
		t.Fatal("later notification ignored used_event")
	}
}

func TestNoInterrupt(t *testing.T) {
	g := newGuest(t)
	r := newRing(g, 8)
	q := r.open(t)
	count := signals(t, q)
	c := NewDescChain(8)
	r.setDesc(0, desc{dataGPA, 8, 0, 0})
	r.setAvailEvent(0x1234)
	round := func(flags uint16, n int) uint64 {
		r.setAvailFlags(flags)
		for range n {
			r.publish(0)
			if ok, err := q.Pop(c, g.mem); !ok || err != nil {
				t.Fatal(ok, err)
			}
			q.Push(0, 0)
		}
		if err := q.Notify(); err != nil {
			t.Fatal(err)
		}
		return count()
	}
	if got := round(0, 1); got != 1 {
		t.Fatalf("%d signals without NO_INTERRUPT", got)
	}
	if got := round(availNoInterrupt, 3); got != 0 {
		t.Fatalf("%d signals with NO_INTERRUPT", got)
	}
	if got := round(0, 2); got != 1 {
		t.Fatalf("%d signals after clearing NO_INTERRUPT", got)
	}
	r.setUsedEvent(0x4000) // ignored without EVENT_IDX
	if got := round(0, 1); got != 1 {
		t.Fatalf("used_event consulted without EVENT_IDX")
	}
	if r.availEvent() != 0x1234 {
		t.Fatal("avail_event written without EVENT_IDX")
	}
	if q.EnableNotify() {
		t.Fatal("EnableNotify on an empty ring")
	}
}

func TestConcurrentPush(t *testing.T) {
	const Q = 256
	g := newGuest(t)
	r := newRing(g, Q)
	r.eventIdx = true
	q := r.open(t)
	count := signals(t, q)
	r.setUsedEvent(0)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range Q / 4 {
				head := uint16(w*(Q/4) + i)
				if i%2 == 0 {
					q.Push(Token(head), uint32(head))
				} else if err := q.PushNotify(Token(head), uint32(head)); err != nil {
					t.Error(err)
				}
				if i%7 == 0 {
					q.Notify()
				}
			}
		}()
	}
	wg.Wait()
	q.Notify()
	if r.usedIdx() != Q {
		t.Fatalf("used idx %d, want %d", r.usedIdx(), Q)
	}
	seen := make([]bool, Q)
	for i := range uint16(Q) {
		id, n := r.usedElem(i)
		if id >= Q || seen[id] || n != id {
			t.Fatalf("used elem %d = {%d %d}", i, id, n)
		}
		seen[id] = true
	}
	if got := count(); got != 1 {
		t.Fatalf("%d signals for used_event 0, want 1", got)
	}
}
