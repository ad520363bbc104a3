package integration

import (
	"errors"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// getattrRequest is a valid GETATTR of the root, the request each
// malformation breaks.
func getattrRequest(c *fsc, mode vmm.IndirectMode) vmm.FuseRequest {
	in := vmm.BuildRequest(c.Header(vmm.OpGetattr, vmm.RootID), 0, make([]byte, 16))
	return vmm.FuseRequest{In: in, OutArgs: vmm.FuseAttrOutSize, Indirect: mode}
}

// TestMalformedRing applies every vmm malformation to a request on ring 1.
// A malformed chain must come back with used len 0 (or, for a head out of
// range, not at all: there is no chain to return) and the ring must go on
// serving: the next valid request on the same ring succeeds. An avail index
// that jumps by more than the ring size breaks the ring: then another ring
// still serves, and a restart of the broken ring (at its base, or a guest
// reset) recovers it.
func TestMalformedRing(t *testing.T) {
	if packedRings {
		t.Skip("split-ring malformations; TestMalformedPackedRing covers packed rings")
	}
	eachMalformation(t, vmm.Malformations(), opts(), func(t *testing.T, kind vmm.Malformation, d *daemon, dev *vmm.Device, c *fsc) {
		q := dev.Queue(1)
		for round := range 3 { // a hostile guest repeats itself
			ch, err := q.AddMalformed(kind, getattrRequest(c, vmm.IndirectAuto))
			if err != nil {
				t.Fatalf("building %v: %v", kind, err)
			}
			if err := q.Kick(); err != nil {
				t.Fatal(err)
			}
			switch kind {
			case vmm.BadAvailJump:
				brokenRing(t, d, dev, c, round)
				continue
			case vmm.BadHeadOutOfRange:
				// Nothing to return; the entry is consumed.
			default:
				n, err := ch.Wait(opTimeout)
				if err != nil {
					t.Fatalf("round %d: %v chain not returned: %v", round, kind, err)
				}
				if n != 0 {
					t.Errorf("round %d: %v chain returned with used len %d, want 0", round, kind, n)
				}
			}
			// The same ring still serves.
			c.check()
		}
		c.roundTrip(d, "after", pattern(int(kind), 20000))
		newFS(t, dev, 2).check()
		d.alive()
		if kind != vmm.BadAvailJump && kind != vmm.BadHeadOutOfRange {
			noViolations(t, dev)
		}
		// Logged: as a malformed chain, or (a zero-length header
		// buffer is harmless to the ring) by the FUSE layer.
		if kind != vmm.BadAvailJump && d.logCount("malformed chain")+d.logCount("without a complete fuse_in_header") == 0 {
			t.Errorf("the malformed request was not logged")
		}
	})
}

// brokenRing checks the state after an avail index jump (packed: a chain
// whose end cannot be found) on ring 1 and
// recovers the ring: by a pause/resume at the base it reports (round 0), by
// a driver reset of that ring in new memory (round 1) or by a guest reboot
// (round 2).
func brokenRing(t *testing.T, d *daemon, dev *vmm.Device, c *fsc, round int) {
	t.Helper()
	q := dev.Queue(1)
	// The ring is broken: a valid request after the jump is not served
	// (a packed chain longer than the ring leaves no slot for one).
	fc, err := q.SubmitFuse(getattrRequest(c, vmm.IndirectAuto))
	switch {
	case errors.Is(err, vmm.ErrRingFull) && q.Packed():
	case err != nil:
		t.Fatal(err)
	default:
		select {
		case <-fc.Done():
			t.Logf("round %d: a request after the break was served (used len %d)", round, fc.UsedLen())
		case <-time.After(300 * time.Millisecond):
		}
	}
	// Another ring still serves.
	newFS(t, dev, 2).check()
	switch round {
	case 0:
		base, err := dev.StopQueue(1)
		if err != nil {
			t.Fatalf("stop of the broken ring: %v", err)
		}
		if _, err := usedAtStop(q, base); err != nil {
			t.Errorf("broken ring: %v", err)
		}
		// The driver resets its ring state and moves the ring; the
		// session is unchanged.
		if err := dev.RestartQueue(1, 0, true); err != nil {
			t.Fatalf("restart of the broken ring: %v", err)
		}
	case 1:
		if _, err := dev.StopQueue(1); err != nil {
			t.Fatal(err)
		}
		if err := dev.RestartQueue(1, 0, true); err != nil {
			t.Fatal(err)
		}
		c.check()
		// And a plain pause/resume of the recovered ring.
		base, err := dev.StopQueue(1)
		if err != nil {
			t.Fatal(err)
		}
		if err := dev.RestartQueue(1, base, false); err != nil {
			t.Fatal(err)
		}
	case 2:
		if err := dev.GuestReset(); err != nil {
			t.Fatalf("guest reset: %v", err)
		}
		c.mount()
	}
	c.check()
	if n := d.logCount("ring stopped serving"); n < 1 {
		t.Errorf("no log line for the broken ring")
	}
}

// TestMalformedRingDirect repeats the direct-chain malformations with
// INDIRECT_DESC not negotiated, and the indirect ones then fail for that
// reason alone.
func TestMalformedRingNoIndirect(t *testing.T) {
	if packedRings {
		t.Skip("split-ring malformations; TestMalformedPackedRing covers packed rings")
	}
	d := startDaemon(t)
	o := opts()
	o.Features = vmm.DefaultFeatures &^ vmm.Bit(vmm.FIndirectDesc)
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	q := dev.Queue(1)
	for _, kind := range vmm.Malformations() {
		if kind == vmm.BadAvailJump || kind == vmm.BadHeadOutOfRange {
			continue
		}
		ch, err := q.AddMalformed(kind, getattrRequest(c, vmm.IndirectNever))
		if err != nil {
			t.Fatalf("building %v: %v", kind, err)
		}
		if err := q.Kick(); err != nil {
			t.Fatal(err)
		}
		if n, err := ch.Wait(opTimeout); err != nil || n != 0 {
			t.Errorf("%v: used len %d, %v; want 0", kind, n, err)
		}
		c.check()
	}
	c.roundTrip(d, "after", pattern(1, 9000))
	noViolations(t, dev)
}

// TestMalformedMixedWithValid interleaves malformed chains with valid
// requests in one batch: each valid one is answered, each malformed one
// returned with used len 0, none twice.
func TestMalformedMixedWithValid(t *testing.T) {
	d := startDaemon(t)
	o := opts()
	o.QueueSize = 1024
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	q := dev.Queue(1)
	type sub struct {
		bad  *vmm.Chain
		good *vmm.FuseCall
		kind vmm.Malformation
	}
	var subs []sub
	kinds := vmm.Malformations()
	if q.Packed() {
		kinds = vmm.PackedMalformations()
	}
	for round := range 4 {
		for _, kind := range kinds {
			// Only the chains returned with len 0; a reused id may be
			// answered in full (TestMalformedPackedRing).
			if kind.Reaction() != vmm.ReturnedEmpty || kind == vmm.BadDuplicateID {
				continue
			}
			ch, err := q.AddMalformed(kind, getattrRequest(c, vmm.IndirectAuto))
			if err != nil {
				t.Fatalf("round %d: building %v: %v", round, kind, err)
			}
			subs = append(subs, sub{bad: ch, kind: kind})
			fc, err := q.AddFuse(getattrRequest(c, vmm.IndirectAuto))
			if err != nil {
				t.Fatal(err)
			}
			subs = append(subs, sub{good: fc})
		}
	}
	if err := q.Kick(); err != nil {
		t.Fatal(err)
	}
	for _, s := range subs {
		if s.bad != nil {
			if n, err := s.bad.Wait(opTimeout); err != nil || n != 0 {
				t.Errorf("%v: used len %d, %v", s.kind, n, err)
			}
			continue
		}
		b, err := s.good.Wait(opTimeout)
		if err != nil {
			t.Fatal(err)
		}
		if h, _, err := vmm.ParseReply(b); err != nil || h.Error != 0 {
			t.Errorf("valid request between malformed ones: %+v %v", h, err)
		}
	}
	noViolations(t, dev)
}

// TestMalformedPackedRing applies every packed-ring malformation to a
// request on ring 1 of a packed device, as TestMalformedRing does on split
// rings (vmm.Malformation.Reaction says what a correct device does): a
// chain whose extent is known comes back as used with len 0 under its id,
// the used index moved by its slots, so that later requests on the same
// ring still complete; a chain longer than the ring, or one that runs into
// a slot that is not available, breaks the ring (logged) until it is set
// up again, while the other rings serve.
func TestMalformedPackedRing(t *testing.T) {
	eachMalformation(t, vmm.PackedMalformations(), requirePacked(opts()), func(t *testing.T, kind vmm.Malformation, d *daemon, dev *vmm.Device, c *fsc) {
		q := dev.Queue(1)
		if !q.Packed() {
			t.Fatal("ring 1 is not packed")
		}
		for round := range 3 {
			ch, err := q.AddMalformed(kind, getattrRequest(c, vmm.IndirectAuto))
			if err != nil {
				t.Fatalf("building %v: %v", kind, err)
			}
			if err := q.Kick(); err != nil {
				t.Fatal(err)
			}
			if kind.Reaction() == vmm.RingBroken {
				brokenRing(t, d, dev, c, round)
				continue
			}
			n, err := ch.Wait(opTimeout)
			if err != nil {
				t.Fatalf("round %d: %v chain not returned: %v", round, kind, err)
			}
			if orig := ch.Original(); orig != nil {
				// A reused id: the first request is answered in
				// full; the second with len 0 if the daemon still
				// held the first when it read it, else in full.
				if _, err := orig.Wait(opTimeout); err != nil {
					t.Fatalf("round %d: the request whose id was reused: %v", round, err)
				}
				if n != 0 && n != 16+vmm.FuseAttrOutSize {
					t.Errorf("round %d: the chain reusing an id returned with used len %d", round, n)
				}
			} else if n != 0 {
				t.Errorf("round %d: %v chain returned with used len %d, want 0", round, kind, n)
			}
			c.check() // the same ring still serves
		}
		c.roundTrip(d, "after", pattern(int(kind), 20000))
		newFS(t, dev, 2).check()
		d.alive()
		if kind.Reaction() != vmm.RingBroken {
			noViolations(t, dev)
		}
		if kind != vmm.BadDuplicateID && kind.Reaction() != vmm.RingBroken &&
			d.logCount("malformed chain")+d.logCount("without a complete fuse_in_header") == 0 {
			t.Errorf("the malformed request was not logged")
		}
	})
}

// eachMalformation runs fn, for each kind and for queues of 128 and 1024
// entries, on a fresh daemon and a device made with o (3 rings) whose ring
// 1 carries a mounted session c.
func eachMalformation(t *testing.T, kinds []vmm.Malformation, o vmm.Options,
	fn func(t *testing.T, kind vmm.Malformation, d *daemon, dev *vmm.Device, c *fsc)) {
	for _, kind := range kinds {
		for _, size := range []uint16{128, 1024} {
			name := kind.String()
			if size != 128 {
				name += "-q1024"
			}
			t.Run(name, func(t *testing.T) {
				d := startDaemon(t)
				o := o
				o.Queues, o.QueueSize = 3, size
				dev := d.connect(o)
				c := newFS(t, dev, 1)
				c.mount()
				fn(t, kind, d, dev, c)
			})
		}
	}
}
